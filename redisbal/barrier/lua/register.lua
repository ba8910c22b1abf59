--[[
  register: announce engines before their first report, so that the first
  snapshot waits for them. Used by Reporter.register and by the
  coordinator for the engines its config expects.

  KEYS: the deployment's seven keys (includes/deployment.lua)
  ARGV[1] deployment name
  ARGV[2] "PUBLISH" or "SPUBLISH"
  ARGV[3] epoch candidate (includes/generation.lua)
  ARGV[4..] engine ids
  Returns: the number of engines newly registered (0 on a retry).
  Errors: "redisbal: bad <field>: ..." before anything is written.

  A registered engine that never reports expires after dead_after_ms. After
  the first snapshot a registration only starts the heartbeat: the engine
  joins snapshots with its first report (provisional until it is past the
  published step).
]]
--- @include "args"
--- @include "deployment"
--- @include "time"
--- @include "generation"
--- @include "record"

local d, err = open_deployment(KEYS, ARGV, 3, nil)
if not d then return fail(err) end
for i = 4, #ARGV do
  if not name_arg(ARGV[i]) then return fail('bad engine_id: ' .. ARGV[i]) end
end
local now, now_text = now_ms()
if not ensure_epoch(d, ARGV[3], now) then return fail('bad epoch candidate') end
local pub = published_score(d)
-- a registered engine's record: its head line only, the heartbeat due now
local head = (pub < 0 and 'b' or 'p') .. now_text
local added = 0
for i = 4, #ARGV do
  if redis.call('HSETNX', d.reports, ARGV[i], head) == 1 then
    redis.call('ZADD', d.members, now_text, ARGV[i])
    if pub < 0 then redis.call('HINCRBY', d.reports, '.behind', 1) end
    redis.call('HINCRBY', d.meta, 'joined', 1)
    added = added + 1
  end
end
return added
