--[[
  leave: an engine leaves the deployment gracefully, atomically.

  KEYS: the deployment's seven keys (includes/deployment.lua)
  ARGV[1] deployment name
  ARGV[2] "PUBLISH" or "SPUBLISH"
  ARGV[3] engine id
  ARGV[4] optional: the leaving process's incarnation, or "-" (any)
  Returns: {removed, version}: removed 1, or 0 when it was not a member (a
  retry is harmless) or when the record belongs to another incarnation (a
  replaced process leaving late takes nothing with it); version of the
  snapshot published for the change, 0 if none.
  Errors: "redisbal: bad <field>: ..." before anything is written.
]]
--- @include "args"
--- @include "deployment"
--- @include "time"
--- @include "record"
--- @include "incarnation"
--- @include "barrier"
--- @include "membership"

local d, err = open_deployment(KEYS, ARGV, 3, 4)
if not d then return fail(err) end
local engine = name_arg(ARGV[3])
if not engine then return fail('bad engine_id: ' .. ARGV[3]) end
local inc = incarnation_arg(ARGV[4] or '-')
if not inc then return fail('bad incarnation: ' .. ARGV[4]) end
if not redis.call('HGET', d.reports, '.epoch') then return {0, 0} end
if inc ~= '-' then
  local text = redis.call('HGET', d.reports, engine)
  local owner = text and parse_record(text).inc
  if owner and owner ~= '-' and owner ~= inc then return {0, 0} end
end
local now = now_ms()
local removed = remove_engine(d, engine, 'left', now)
local version = 0
if removed == 1 then version = publish_after_change(d, now) end
return {removed, version}
