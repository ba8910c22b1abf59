--[[
  leave: an engine leaves the deployment gracefully, atomically.

  KEYS: the deployment's seven keys (includes/deployment.lua)
  ARGV[1] deployment name
  ARGV[2] "PUBLISH" or "SPUBLISH"
  ARGV[3] engine id
  Returns: {removed, version}: removed 1, or 0 when it was not a member (a
  retry is harmless); version of the snapshot published for the change, 0 if
  none.
  Errors: "redisbal: bad <field>: ..." before anything is written.
]]
--- @include "args"
--- @include "deployment"
--- @include "time"
--- @include "barrier"
--- @include "membership"

local d, err = open_deployment(KEYS, ARGV, 3, 3)
if not d then return fail(err) end
local engine = name_arg(ARGV[3])
if not engine then return fail('bad engine_id: ' .. ARGV[3]) end
if not redis.call('HGET', d.reports, '.epoch') then return {0, 0} end
local removed = remove_engine(d, engine, 'left')
local version = 0
if removed == 1 then version = publish_after_change(d, (now_ms())) end
return {removed, version}
