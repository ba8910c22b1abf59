--[[
  force_7.lua: the stall guard. When the barrier has waited stall_ms since the
  first engine moved past the published step, publish the cut at the lowest
  step any engine has moved to, marked forced, naming the laggards (engines
  still at or before the published step) with the age of their last report.

  Never forces over an engine that has not reported at all in this epoch: the
  first snapshot must hold every registered engine (invariant 5); such an
  engine either reports or expires after dead_after_ms.

  KEYS: the seven keys of common.lua.
  ARGV[1] deployment name, ARGV[2] "PUBLISH" or "SPUBLISH",
  ARGV[3] stall_ms override ("" = the config's)
  ARGV[4] fence token of the caller's lease, or "" (optional; see lease_8.lua)
  Returns: {version published (0 if none), laggard ids...}
]]

cold() -- the cold paths' helpers (common.lua)
local deployment, pubcmd = ARGV[1], ARGV[2]
local err = common_args(deployment, pubcmd, 3, 4)
if err then return fail(err) end
local fence_err = fenced(ARGV[4])
if fence_err then return fence_err end
local cfg = config()
if ARGV[3] ~= '' then
  local s = int_arg(ARGV[3], 0, 86400000)
  if not s then return fail('bad stall_ms: ' .. tostring(ARGV[3])) end
  cfg.stall_ms = s
end
local h = redis.call('HMGET', K_REPORTS, F_EPOCH, F_SINCE, F_PUB)
if not h[1] then return {0} end
local now = now_ms()
local since = tonumber(h[2])
if not since or now - since < cfg.stall_ms then return {0} end
if (tonumber(h[3]) or -1) < 0 then
  local m = redis.call('HMGET', K_META, 'epoch_start', 'grace')
  if in_grace(m[2], m[1], now, cfg) then return {0} end
  -- a registered engine without any report holds the first snapshot
  local flat = redis.call('HGETALL', K_REPORTS)
  for i = 1, #flat, 2 do
    local rec = flat[i + 1]
    if not HOT[flat[i]] and not string.find(rec, '\n', 2, true) and string.sub(rec, 1, 1) == 'b' then
      return {0}
    end
  end
end
local version, lag = publish('forced', now, deployment, pubcmd)
local out = {version}
if version ~= 0 then
  for _, e in ipairs(lag) do out[#out + 1] = e end
end
return out
