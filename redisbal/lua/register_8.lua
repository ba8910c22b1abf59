--[[
  register_8.lua: announce engines before their first report, so that the
  first snapshot waits for them (invariant 5). Used by EngineReporter.register
  and by the coordinator for the engines its config expects.

  KEYS: the eight keys of common.lua.
  ARGV[1] deployment name, ARGV[2] "PUBLISH" or "SPUBLISH",
  ARGV[3] epoch candidate, ARGV[4..] engine ids
  Returns: number of engines newly registered (0 on a retry).
  A registered engine that never reports expires after dead_after_ms. After
  the first snapshot a registration only starts the heartbeat: the engine
  joins snapshots with its first report.
]]

local deployment, pubcmd = ARGV[1], ARGV[2]
local err = common_args(deployment, pubcmd)
if err then return fail(err) end
for i = 4, #ARGV do
  if not name_arg(ARGV[i]) then return fail('bad engine_id: ' .. tostring(ARGV[i])) end
end
local now = now_ms()
if not ensure_epoch(ARGV[3], now) then return fail('bad epoch candidate') end
local pub = published_score()
local added = 0
for i = 4, #ARGV do
  if redis.call('ZADD', K.members, 'NX', fmt(now), ARGV[i]) == 1 then
    added = added + 1
    if pub < 0 then redis.call('ZADD', K.barrier, 'NX', '-1', ARGV[i]) end
  end
end
return added
