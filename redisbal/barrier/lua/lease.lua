--[[
  lease: the coordinator lease, with a fencing counter.

  The lease lives in the config hash (fields lease_owner, lease_until_ms,
  fence), among the keys every operation gets. Taking the lease over from
  another owner (or after it expired) increments fence; the holder passes its
  fence to reap and force, which refuse a stale one: a coordinator that was
  paused and comes back after a standby took over cannot act on old authority.

  KEYS: the deployment's seven keys (includes/deployment.lua)
  ARGV[1] deployment name
  ARGV[2] "PUBLISH" or "SPUBLISH"
  ARGV[3] owner id
  ARGV[4] ttl_ms (within LEASE_TTL of redisbal/config.py)
  ARGV[5] "acquire" or "release"
  Returns: {held (1 or 0), fence, current owner ("" if none), ms left on the
  lease (0 after a release)}.
  Errors: "redisbal: bad <field>: ..." before anything is written.
]]
--- @include "args"
--- @include "deployment"
--- @include "time"

local d, err = open_deployment(KEYS, ARGV, 5, 5)
if not d then return fail(err) end
local owner = name_arg(ARGV[3])
if not owner then return fail('bad owner: ' .. ARGV[3]) end
local ttl = int_arg(ARGV[4], LEASE_TTL.lo, LEASE_TTL.hi)
if not ttl then return fail('bad ttl_ms: ' .. ARGV[4]) end
local action = ARGV[5]
if action ~= 'acquire' and action ~= 'release' then
  return fail('bad lease action: ' .. action)
end
local now = now_ms()
local c = redis.call('HMGET', d.config, 'lease_owner', 'lease_until_ms', 'fence')
local holder, until_ms, fence = c[1], tonumber(c[2]) or 0, tonumber(c[3]) or 0
if action == 'release' then
  if holder == owner then redis.call('HSET', d.config, 'lease_until_ms', '0') end
  return {0, fence, holder or '', 0}
end
if holder and holder ~= owner and until_ms > now then
  return {0, fence, holder, until_ms - now} -- held by another
end
if holder ~= owner or until_ms <= now then
  fence = redis.call('HINCRBY', d.config, 'fence', 1) -- taken over, or after expiry
end
redis.call('HSET', d.config, 'lease_owner', owner, 'lease_until_ms', int_text(now + ttl))
return {1, fence, owner, ttl}
