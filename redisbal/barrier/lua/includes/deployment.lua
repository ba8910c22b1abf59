--[[
  deployment: the keys of one deployment, the checks every operation makes
  before touching them, the deployment's settings and the barrier's fields
  (docs/DESIGN.md has the key layout).

  Every operation gets the same seven KEYS, all in one hash slot (they share
  the hash tag "{<deployment>}"; redisbal/keys.py builds them):
    KEYS[1] config    HASH    settings (dead_after_ms, stall_ms, ...) and the
                              coordinator lease (lease_owner, lease_until_ms, fence)
    KEYS[2] epoch     STRING  id of this generation of state
    KEYS[3] members   ZSET    engine -> ms of its last heartbeat (liveness)
    KEYS[4] reports   HASH    engine -> its record (includes/record.lua), and the
                              barrier's fields (below)
    KEYS[5] meta      HASH    version, counters, what the snapshot says is gone
    KEYS[6] snapshot  STRING  the latest snapshot (includes/publish.lua)
    KEYS[7] channel   the pub/sub channel of the snapshots: passed in KEYS, not
                      built here, so that Redis Cluster routes by its slot
  An operation reaches them only through the table open_deployment returns
  (d.config, d.epoch, ...), never by building a name.

  The barrier's fields in the reports hash. They sit beside the records so
  that a report reads and writes everything it needs in one HMGET and one
  HSET; engine ids start with a letter or digit, so ".x" is never an engine.
    .epoch      the epoch (as KEYS[2]; read with the others)
    .pub        score (includes/score.lua) of the last published snapshot,
                -1 before the first one of the epoch
    .behind     barrier members whose latest report is at or before .pub
                (a registered engine without a report counts too): the
                snapshot is due when it reaches 0
    .since      ms when the first member moved past .pub (the stall clock)
    .next_reap  ms when a report next expires dead engines on the way
    .pub_at     ms when .pub last moved forward
    .rebase     the offset of the step sequence that lockstep engines joining
                behind .pub started last (report.lua), and .rebase_ms when
    .roster     the ids and incarnations of the last compact snapshot
                (includes/publish.lua), absent after a full one or a new epoch
]]
--- @include "settings"
--- @include "args"

-- KEYS[i] must be "redisbal:{<deployment>}:" .. KEY_SUFFIXES[i]
local KEY_SUFFIXES = {'config', 'epoch', 'members', 'reports', 'meta', 'snapshot', 'snapshots'}


-- The deployment an operation works on, after the checks every operation makes
-- before it touches anything: the number of arguments (nmin..nmax; nmax nil for
-- no bound), the deployment name (ARGV[1]), that KEYS are exactly its seven
-- keys (missing, extra or foreign keys get an error, never a write under
-- another deployment's keys) and the publish command (ARGV[2]).
-- Returns the deployment table {name, pubcmd, config, epoch, members, reports,
-- meta, snapshot, channel}, or nil and the error message.
local function open_deployment(keys, argv, nmin, nmax)
  local n = #argv
  if n < nmin or (nmax and n > nmax) then
    local expected = nmin .. (nmax == nmin and '' or (nmax and '..' .. nmax or ' or more'))
    return nil, 'expected ' .. expected .. ' arguments, got ' .. n
  end
  local name, pubcmd = argv[1], argv[2]
  if not name_arg(name) then return nil, 'bad deployment name' end
  if #keys ~= #KEY_SUFFIXES then
    return nil, 'expected ' .. #KEY_SUFFIXES .. ' keys, got ' .. #keys
  end
  local prefix = 'redisbal:{' .. name .. '}:'
  for i = 1, #KEY_SUFFIXES do
    local expected = prefix .. KEY_SUFFIXES[i]
    if keys[i] ~= expected then return nil, 'bad key ' .. i .. ': expected ' .. expected end
  end
  if pubcmd ~= 'PUBLISH' and pubcmd ~= 'SPUBLISH' then
    return nil, 'bad publish command (PUBLISH or SPUBLISH)'
  end
  return {
    name = name, pubcmd = pubcmd, config = keys[1], epoch = keys[2], members = keys[3],
    reports = keys[4], meta = keys[5], snapshot = keys[6], channel = keys[7],
  }
end

-- One setting (a number), its default when unset.
local function config_value(d, field)
  return tonumber(redis.call('HGET', d.config, field)) or SETTINGS[field].default
end

-- Nil when token is "" (an unfenced call) or the config's current fence (the
-- caller still holds the coordinator lease: lease.lua); else the error reply.
local function check_fence(d, token)
  if token == nil or token == '' then return nil end
  local fence = redis.call('HGET', d.config, 'fence') or '0'
  if fence ~= token then
    return fail("fenced: this coordinator's lease (fence " .. token ..
      ') was taken over (fence ' .. fence .. ')')
  end
  return nil
end

-- Whether a field of the reports hash is an engine's record (not .pub, ...).
local function is_engine_field(field)
  return string.sub(field, 1, 1) ~= '.'
end

-- .pub as a number: the score of the last published snapshot, -1 before one.
local function published_score(d)
  return tonumber(redis.call('HGET', d.reports, '.pub') or '-1')
end
