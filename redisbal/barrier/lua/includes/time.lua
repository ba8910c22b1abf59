--[[
  time: the server's clock. Every time redisbal stores is the Redis server's
  time in whole milliseconds since the Unix epoch, so that engines, routers and
  coordinators on different hosts never compare their own clocks.
]]

-- The server's time in ms, as a number and as text. TIME answers seconds and
-- microseconds (0..999999, as text): the ms text is the seconds followed by the
-- first three of the six microsecond digits.
local function now_ms()
  local t = redis.call('TIME')
  local us = t[2]
  if #us < 6 then us = string.rep('0', 6 - #us) .. us end
  local text = t[1] .. string.sub(us, 1, 3)
  return tonumber(text), text
end
