--[[
  new_epoch_7.lua: start a new epoch without losing the current state. The
  coordinator calls it when the server behind the URL changed identity
  (failover): a promoted replica may lag, so versions may repeat; the new
  epoch tells routers to resynchronise instead of ignoring them.

  KEYS: the seven keys of common.lua.
  ARGV[1] deployment name, ARGV[2] "PUBLISH" or "SPUBLISH", ARGV[3] new epoch
  Returns: {epoch, version republished (0 if nothing was published yet)}
]]

cold() -- the cold paths' helpers (common.lua)
local deployment, pubcmd = ARGV[1], ARGV[2]
local err = common_args(deployment, pubcmd, 3, 3)
if err then return fail(err) end
if not name_arg(ARGV[3]) then return fail('bad epoch: ' .. tostring(ARGV[3])) end
local now = now_ms()
if not redis.call('HGET', K_REPORTS, F_EPOCH) then
  ensure_epoch(ARGV[3], now)
  return {ARGV[3], 0}
end
redis.call('SET', K_EPOCH, ARGV[3])
redis.call('HSET', K_REPORTS, F_EPOCH, ARGV[3])
local pub = published_score()
local version = 0
if pub >= 0 then version = (publish(pub, now, deployment, pubcmd)) end
return {ARGV[3], version}
