--[[
  configure: the coordinator writes the deployment's settings.

  KEYS: the deployment's seven keys (includes/deployment.lua)
  ARGV[1] deployment name
  ARGV[2] "PUBLISH" or "SPUBLISH"
  ARGV[3] epoch candidate (includes/generation.lua)
  ARGV[4..] field, value pairs; the fields:
    dead_after_ms, stall_ms, tick_ms, join_grace_ms, idle_publish_ms,
    stall_after_ms, suspect_ms
        whole ms, within the bounds of redisbal/config.py (includes "settings")
    compact_from
        whole engines, the same way (includes/publish.lua)
    expected   comma-separated engine ids, may be ""
    owner      the coordinator's id
  Returns: the epoch (started if the state was new or lost).
  Errors: "redisbal: bad <field>: ..." or "redisbal: unknown config field: ..."
  before anything is written.
]]
--- @include "args"
--- @include "deployment"
--- @include "time"
--- @include "generation"


local d, err = open_deployment(KEYS, ARGV, 3, nil)
if not d then return fail(err) end
if (#ARGV - 3) % 2 ~= 0 then return fail('config needs field, value pairs') end
for i = 4, #ARGV, 2 do
  local field, value = ARGV[i], ARGV[i + 1]
  local setting = SETTINGS[field]
  if setting then
    if not int_arg(value, setting.lo, setting.hi) then
      return fail('bad ' .. field .. ': ' .. value ..
        ' (whole ' .. setting.unit .. ' in ' .. setting.lo .. '..' .. setting.hi .. ')')
    end
  elseif field == 'expected' then
    if #value > 65536 or string.find(value, '[^A-Za-z0-9_.,%-]') then
      return fail('bad expected: comma-separated engine ids')
    end
  elseif field == 'owner' then
    if not name_arg(value) then return fail('bad owner: ' .. value) end
  else
    return fail('unknown config field: ' .. field)
  end
end
local epoch = ensure_epoch(d, ARGV[3], now_ms())
if not epoch then return fail('bad epoch candidate') end
if #ARGV > 3 then
  local settings = {}
  for i = 4, #ARGV do settings[#settings + 1] = ARGV[i] end
  redis.call('HSET', d.config, unpack(settings))
end
return epoch
