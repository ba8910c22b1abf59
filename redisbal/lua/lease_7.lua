--[[
  lease_7.lua: the coordinator lease, with a fencing counter.

  The lease lives in the config hash (fields lease_owner, lease_until_ms,
  fence) so that it shares the scripts' keys. Taking the lease over from
  another owner (or after it expired) increments fence; the holder passes its
  fence to reap/force, which refuse a stale one: a coordinator that was paused
  and comes back after a standby took over cannot act on old authority.

  KEYS: the seven keys of common.lua.
  ARGV[1] deployment name, ARGV[2] "PUBLISH" or "SPUBLISH",
  ARGV[3] owner id, ARGV[4] ttl_ms, ARGV[5] "acquire" or "release"
  Returns: {held (1/0), fence, current owner, ms left on the lease}
]]

local deployment, pubcmd = ARGV[1], ARGV[2]
local err = common_args(deployment, pubcmd, 5, 5)
if err then return fail(err) end
local owner = name_arg(ARGV[3])
if not owner then return fail('bad owner: ' .. tostring(ARGV[3])) end
local ttl = int_arg(ARGV[4], 100, 600000)
if not ttl then return fail('bad ttl_ms: ' .. tostring(ARGV[4])) end
local now = now_ms()
local c = redis.call('HMGET', K_CONFIG, 'lease_owner', 'lease_until_ms', 'fence')
local cur, untl, fence = c[1], tonumber(c[2]) or 0, tonumber(c[3]) or 0
if ARGV[5] == 'release' then
  if cur == owner then redis.call('HSET', K_CONFIG, 'lease_until_ms', '0') end
  return {0, fence, cur or '', 0}
elseif ARGV[5] ~= 'acquire' then
  return fail('bad lease action: ' .. tostring(ARGV[5]))
end
if cur and cur ~= owner and untl > now then
  return {0, fence, cur, untl - now}
end
if cur ~= owner or untl <= now then
  fence = redis.call('HINCRBY', K_CONFIG, 'fence', 1)
end
redis.call('HSET', K_CONFIG, 'lease_owner', owner, 'lease_until_ms', fmt(now + ttl))
return {1, fence, owner, ttl}
