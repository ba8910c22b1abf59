--[[
  force: the stall guard. When the barrier has waited stall_ms since the first
  engine moved past the published step, publish the cut at the lowest step any
  member has moved to, marked forced, naming the laggards (members still at or
  before the published step) with the age of their last report.

  Never forces over a registered engine that has not reported at all in this
  epoch: the first snapshot holds every registered engine; such an engine
  either reports or expires after dead_after_ms.

  KEYS: the deployment's seven keys (includes/deployment.lua)
  ARGV[1] deployment name
  ARGV[2] "PUBLISH" or "SPUBLISH"
  ARGV[3] stall_ms to use instead of the config's, or "" (0..86400000)
  ARGV[4] optional: the fence of the caller's lease (lease.lua), or ""
  Returns: {version, laggard ids...}: version of the snapshot published, 0 if
  none (the laggards only with a snapshot).
  Errors: "redisbal: bad <field>: ...", or "redisbal: fenced: ..." when the
  caller's lease was taken over; nothing is written then.
]]
--- @include "args"
--- @include "deployment"
--- @include "time"
--- @include "record"
--- @include "generation"
--- @include "publish"

local d, err = open_deployment(KEYS, ARGV, 3, 4)
if not d then return fail(err) end
local fenced = check_fence(d, ARGV[4])
if fenced then return fenced end
local stall_ms
if ARGV[3] ~= '' then
  stall_ms = int_arg(ARGV[3], 0, 86400000)
  if not stall_ms then return fail('bad stall_ms: ' .. ARGV[3]) end
end
local h = redis.call('HMGET', d.reports, '.epoch', '.since', '.pub')
if not h[1] then return {0} end
local now = now_ms()
local since = tonumber(h[2])
if not since or now - since < (stall_ms or config_value(d, 'stall_ms')) then return {0} end
if (tonumber(h[3]) or -1) < 0 then -- before the first snapshot
  if in_join_grace(d, now) then return {0} end
  -- a registered engine without any report holds the first snapshot
  local flat = redis.call('HGETALL', d.reports)
  for i = 1, #flat, 2 do
    if is_engine_field(flat[i]) then
      local rec = parse_record(flat[i + 1])
      if rec.flag == 'b' and not rec.score then return {0} end
    end
  end
end
local version, laggards = publish(d, 'forced', now)
local out = {version}
for _, engine in ipairs(laggards) do out[#out + 1] = engine end
return out
