--[[
  force_8.lua: the stall guard. When the barrier has waited stall_ms since the
  first engine moved past the published step, publish the cut at the lowest
  step any engine has moved to, marked forced, naming the laggards (engines
  still at or before the published step) with the age of their last report.

  Never forces over an engine that has not reported at all in this epoch: the
  first snapshot must hold every registered engine (invariant 5); such an
  engine either reports or expires after dead_after_ms.

  KEYS: the eight keys of common.lua.
  ARGV[1] deployment name, ARGV[2] "PUBLISH" or "SPUBLISH",
  ARGV[3] stall_ms override ("" = the config's)
  ARGV[4] fence token of the caller's lease, or "" (optional; see lease_8.lua)
  Returns: {version published (0 if none), laggard ids...}
]]

local deployment, pubcmd = ARGV[1], ARGV[2]
local err = common_args(deployment, pubcmd)
if err then return fail(err) end
local fence_err = fenced(ARGV[4])
if fence_err then return fence_err end
local cfg = config()
if ARGV[3] ~= '' then
  local s = int_arg(ARGV[3], 0, 86400000)
  if not s then return fail('bad stall_ms: ' .. tostring(ARGV[3])) end
  cfg.stall_ms = s
end
if not redis.call('GET', K.epoch) then return {0} end
local now = now_ms()
local since = tonumber(redis.call('HGET', K.meta, 'since') or '')
if not since or now - since < cfg.stall_ms then return {0} end
local pub = published_score()
if pub < 0 then
  if #redis.call('ZRANGEBYSCORE', K.barrier, '-inf', '(0', 'LIMIT', 0, 1) > 0 then return {0} end
  local start = tonumber(redis.call('HGET', K.meta, 'epoch_start') or '0')
  if now - start < cfg.join_grace_ms then return {0} end
end
local ahead = redis.call('ZRANGEBYSCORE', K.barrier, '(' .. fmt(pub), '+inf', 'WITHSCORES',
  'LIMIT', 0, 1)
if #ahead == 0 then return {0} end
local s = tonumber(ahead[2])
local lag = redis.call('ZRANGEBYSCORE', K.barrier, '-inf', '(' .. fmt(s))
local parts = {}
for i, e in ipairs(lag) do
  local seen = tonumber(redis.call('ZSCORE', K.members, e) or now)
  parts[i] = '"' .. e .. '":' .. fmt(now - seen)
end
local out = {publish(s, true, table.concat(parts, ','), now, deployment, pubcmd)}
for _, e in ipairs(lag) do out[#out + 1] = e end
return out
