--[[
  new_epoch: start a new epoch without losing the current state. The
  coordinator calls it when the server behind its URL changed identity (a
  failover): a promoted replica may lag, so versions may repeat; the new epoch
  tells routers to resynchronise instead of ignoring them.

  KEYS: the deployment's seven keys (includes/deployment.lua)
  ARGV[1] deployment name
  ARGV[2] "PUBLISH" or "SPUBLISH"
  ARGV[3] the new epoch
  Returns: {epoch, version republished (0 when nothing was published yet)}.
  Errors: "redisbal: bad <field>: ..." before anything is written.
]]
--- @include "args"
--- @include "deployment"
--- @include "time"
--- @include "generation"
--- @include "publish"

local d, err = open_deployment(KEYS, ARGV, 3, 3)
if not d then return fail(err) end
local epoch = name_arg(ARGV[3])
if not epoch then return fail('bad epoch: ' .. ARGV[3]) end
local now = now_ms()
if not redis.call('HGET', d.reports, '.epoch') then
  new_generation(d, epoch, now)
  return {epoch, 0}
end
redis.call('SET', d.epoch, epoch)
redis.call('HSET', d.reports, '.epoch', epoch)
redis.call('HDEL', d.reports, '.roster') -- a compact republish names its roster again
local pub = published_score(d)
local version = 0
if pub >= 0 then version = (publish(d, pub, now)) end
return {epoch, version}
