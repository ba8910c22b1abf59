--[[
  configure_7.lua: the coordinator writes the deployment's settings.

  KEYS: the seven keys of common.lua.
  ARGV[1] deployment name, ARGV[2] "PUBLISH" or "SPUBLISH",
  ARGV[3] epoch candidate, ARGV[4..] field, value pairs; fields:
    dead_after_ms, stall_ms, tick_ms, join_grace_ms, idle_publish_ms
    (whole numbers of ms), expected (comma-separated engine ids, may be ""),
    owner (coordinator id)
  Returns: the epoch (created if state was lost or new).
]]

cold() -- the cold paths' helpers (common.lua)
local deployment, pubcmd = ARGV[1], ARGV[2]
local err = common_args(deployment, pubcmd, 3, nil)
if err then return fail(err) end
if (#ARGV - 3) % 2 ~= 0 then return fail('config needs field, value pairs') end
local limits = {
  dead_after_ms = {100, 86400000}, stall_ms = {1, 86400000}, tick_ms = {1, 60000},
  join_grace_ms = {0, 600000}, idle_publish_ms = {10, 3600000},
}
for i = 4, #ARGV, 2 do
  local f, v = ARGV[i], ARGV[i + 1]
  local lim = limits[f]
  if lim then
    if not int_arg(v, lim[1], lim[2]) then
      return fail('bad ' .. f .. ': ' .. tostring(v) .. ' (whole ms in ' .. lim[1] .. '..' .. lim[2] .. ')')
    end
  elseif f == 'expected' then
    if #v > 65536 or (v ~= '' and string.find(v, '[^A-Za-z0-9_.,%-]')) then
      return fail('bad expected: comma-separated engine ids')
    end
  elseif f == 'owner' then
    if not name_arg(v) then return fail('bad owner: ' .. tostring(v)) end
  else
    return fail('unknown config field: ' .. tostring(f))
  end
end
local epoch = ensure_epoch(ARGV[3], now_ms())
if not epoch then return fail('bad epoch candidate') end
if #ARGV > 3 then
  local pairs_ = {}
  for i = 4, #ARGV do pairs_[#pairs_ + 1] = ARGV[i] end
  redis.call('HSET', K_CONFIG, unpack(pairs_))
end
return epoch
