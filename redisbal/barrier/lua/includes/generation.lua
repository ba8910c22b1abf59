--[[
  generation: the epoch names one generation of a deployment's state. When it
  is missing the state is new, or was lost (a restart without persistence, a
  flush): the next operation that may create state starts a clean generation
  under the epoch its caller proposes (ARGV[3], "the epoch candidate").

  A caller that had reported (or coordinated) before proposes a candidate
  starting with "r-": the state was lost and the engines that knew it are
  re-registering one by one, so the first snapshot of this generation waits
  join_grace_ms for them. A fresh deployment has nothing to recover and waits
  only for its registrations.
]]
--- @include "args"
--- @include "deployment"

-- Start a clean generation named candidate; returns it, or nil (nothing
-- written) when candidate is not a valid name.
local function new_generation(d, candidate, now)
  if not name_arg(candidate) then return nil end
  redis.call('DEL', d.members, d.reports, d.meta, d.snapshot)
  redis.call('SET', d.epoch, candidate)
  redis.call('HSET', d.reports, '.epoch', candidate, '.pub', '-1', '.behind', '0')
  local grace = string.sub(candidate, 1, 2) == 'r-' and '1' or '0'
  redis.call('HSET', d.meta, 'epoch_start', int_text(now), 'version', '0', 'grace', grace)
  return candidate
end

-- The current epoch, after starting a generation if there is none (nil when
-- that was needed and candidate is not a valid name).
local function ensure_epoch(d, candidate, now)
  local epoch = redis.call('HGET', d.reports, '.epoch')
  if epoch then return epoch end
  return new_generation(d, candidate, now)
end

-- Whether the first snapshot of a recovered generation must still wait for
-- re-registering engines (join_grace_ms from the generation's start).
local function in_join_grace(d, now)
  local m = redis.call('HMGET', d.meta, 'epoch_start', 'grace')
  if m[2] ~= '1' then return false end
  return now - (tonumber(m[1]) or 0) < config_value(d, 'join_grace_ms')
end
