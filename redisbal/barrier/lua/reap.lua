--[[
  reap: the coordinator's housekeeping. Expires engines whose last report is
  older than dead_after_ms, publishes when that (or the end of the join grace)
  completes the barrier, and republishes the published step when nothing was
  published for idle_publish_ms (an idle heartbeat: routers can tell a quiet
  deployment from a dead feed).

  KEYS: the deployment's seven keys (includes/deployment.lua)
  ARGV[1] deployment name
  ARGV[2] "PUBLISH" or "SPUBLISH"
  ARGV[3] the most engines to expire in this call (1..100000)
  ARGV[4] optional: the fence of the caller's lease (lease.lua), or ""
  Returns: {version, expired ids...}: version of the snapshot published, 0 if
  none.
  Errors: "redisbal: bad <field>: ...", or "redisbal: fenced: ..." when the
  caller's lease was taken over; nothing is written then.
]]
--- @include "args"
--- @include "deployment"
--- @include "time"
--- @include "barrier"
--- @include "membership"
--- @include "publish"

local d, err = open_deployment(KEYS, ARGV, 3, 4)
if not d then return fail(err) end
local limit = int_arg(ARGV[3], 1, 100000)
if not limit then return fail('bad limit: ' .. ARGV[3]) end
local fenced = check_fence(d, ARGV[4])
if fenced then return fenced end
if not redis.call('HGET', d.reports, '.epoch') then return {0} end
local now = now_ms()
local dead = expire_engines(d, config_value(d, 'dead_after_ms'), now, limit)
local version
if #dead > 0 then
  version = publish_after_change(d, now)
else
  version = maybe_publish(d, now)
  local pub = published_score(d)
  if version == 0 and pub >= 0 then
    local last = tonumber(redis.call('HGET', d.meta, 'pub_ms') or '0')
    if now - last >= config_value(d, 'idle_publish_ms') then
      version = (publish(d, pub, now))
    end
  end
end
local out = {version}
for _, engine in ipairs(dead) do out[#out + 1] = engine end
return out
