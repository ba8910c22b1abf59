--[[
  register_7.lua: announce engines before their first report, so that the
  first snapshot waits for them (invariant 5). Used by EngineReporter.register
  and by the coordinator for the engines its config expects.

  KEYS: the seven keys of common.lua.
  ARGV[1] deployment name, ARGV[2] "PUBLISH" or "SPUBLISH",
  ARGV[3] epoch candidate, ARGV[4..] engine ids
  Returns: number of engines newly registered (0 on a retry).
  A registered engine that never reports expires after dead_after_ms. After
  the first snapshot a registration only starts the heartbeat: the engine
  joins snapshots with its first report.
]]

cold() -- the cold paths' helpers (common.lua)
local deployment, pubcmd = ARGV[1], ARGV[2]
local err = common_args(deployment, pubcmd, 3, nil)
if err then return fail(err) end
for i = 4, #ARGV do
  if not name_arg(ARGV[i]) then return fail('bad engine_id: ' .. tostring(ARGV[i])) end
end
local now, now_s = now_ms()
if not ensure_epoch(ARGV[3], now) then return fail('bad epoch candidate') end
local pub = published_score()
local added = 0
for i = 4, #ARGV do
  if redis.call('HSETNX', K_REPORTS, ARGV[i], (pub < 0 and 'b' or 'p') .. now_s) == 1 then
    redis.call('ZADD', K_MEMBERS, now_s, ARGV[i])
    if pub < 0 then redis.call('HINCRBY', K_REPORTS, F_BEHIND, 1) end
    redis.call('HINCRBY', K_META, 'joined', 1)
    added = added + 1
  end
end
return added
