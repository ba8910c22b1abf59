--[[
  report: record one engine's counts for one step, and publish the snapshot
  when this report completes the barrier.

  KEYS: the deployment's seven keys (includes/deployment.lua)
  ARGV[1]  deployment name
  ARGV[2]  "PUBLISH" or "SPUBLISH" (a cluster deployment)
  ARGV[3]  epoch candidate: becomes the epoch if the state is new or was lost
           ("r-..." when the caller had state before: includes/generation.lua)
  ARGV[4]  engine id
  ARGV[5]  wave (0..2^20-1); ignored in tick mode
  ARGV[6]  step (0..2^32-1), or "tick": tag the report with the server's tick
           (includes/score.lua), shared by all engines that have no steps
  ARGV[7]  waiting (0..1e9)
  ARGV[8]  running (0..1e9)
  ARGV[9]  kv_usage in [0, 1], or "" when unknown
  ARGV[10] admitted: comma-separated cumulative counts of requests received
           per API-server index, or "" when not reported

  Returns {status, version, wave, step}:
    status   "accepted", or "stale": older than this engine's latest report
             (counted, nothing else changed)
    version  of the snapshot this call published, 0 if none
    wave, step  the tag the report was recorded under (in tick mode, the tick)
  Errors: "redisbal: bad <field>: ..." before anything is written.

  On the way, a report refreshes the engine's heartbeat every dead_after_ms / 8
  and then expires dead engines at most every dead_after_ms / 4, so the barrier
  never waits for a dead engine even without a coordinator.
]]
--- @include "args"
--- @include "deployment"
--- @include "time"
--- @include "score"
--- @include "record"
--- @include "generation"
--- @include "barrier"
--- @include "membership"

local d, err = open_deployment(KEYS, ARGV, 10, 10)
if not d then return fail(err) end
local engine = ARGV[4]
local kv = kv_arg(ARGV[9])
if not kv then return fail('bad kv_usage: ' .. ARGV[9]) end
local waiting = count_arg(ARGV[7])
if not waiting then return fail('bad waiting: ' .. ARGV[7]) end
local running = count_arg(ARGV[8])
if not running then return fail('bad running: ' .. ARGV[8]) end
local admitted = admitted_arg(ARGV[10])
if not admitted then return fail('bad admitted: expected comma-separated counts') end
local tick_mode = ARGV[6] == 'tick'
local wave, step, wave_text, step_text
if not tick_mode then
  wave, wave_text = int_arg(ARGV[5], 0, MAX_WAVE)
  if not wave then return fail('bad wave: ' .. ARGV[5]) end
  step, step_text = int_arg(ARGV[6], 0, STEP_SPAN - 1)
  if not step then return fail('bad step: ' .. ARGV[6]) end
end
if not name_arg(engine) then return fail('bad engine_id: ' .. engine) end

local now, now_text = now_ms()
if tick_mode then
  wave, step = from_score(math.floor(now / config_value(d, 'tick_ms')))
  wave_text, step_text = int_text(wave), int_text(step)
end
local score = to_score(wave, step)

-- the engine's record and the barrier's fields, in one read
local h = redis.call('HMGET', d.reports, engine, '.pub', '.since', '.behind')
if not h[2] then -- no .pub: the state is new or was lost
  if not new_generation(d, ARGV[3], now) then return fail('bad epoch candidate') end
  h = {false, '-1', false, '0'}
end
local pub = tonumber(h[2])
local behind = tonumber(h[4]) or 0
local rec = h[1] and parse_record(h[1])

-- older than this engine's newest accepted report: stale
if rec and rec.score and score < rec.score then
  redis.call('HINCRBY', d.meta, 'stale', 1)
  redis.call('HINCRBY', d.meta, 'stale:' .. engine, 1)
  return {'stale', 0, wave, step}
end

local flag, due, older = 'b', '0', '' -- the new record's head, its older lines
local moved = false -- this report moves a barrier member past pub: one behind less
if not rec then
  -- a joiner: a barrier member, unless it is at or behind the published step,
  -- when it stays provisional so that it cannot hold the barrier back
  if pub >= 0 and score <= pub then flag = 'p' end
  redis.call('HINCRBY', d.meta, 'joined', 1)
else
  flag, due, older = rec.flag, rec.due, older_to_keep(rec, score, pub)
  if score > pub then
    -- a member counted as behind (newest at or before pub, or no report yet)
    -- moves past it; a provisional joiner that gets past pub joins the barrier
    moved = flag == 'b' and (not rec.score or rec.score <= pub)
    flag = 'b'
  end
  if rec.score and score ~= rec.score and score <= pub then
    redis.call('HINCRBY', d.meta, 'late', 1)
  end
end

-- the heartbeat in members is refreshed every dead_after_ms / 8, and dead
-- engines are expired on a refresh at most every dead_after_ms / 4
local refresh = now >= (tonumber(due) or 0)
local reap_due = refresh and now >= (tonumber(redis.call('HGET', d.reports, '.next_reap')) or 0)
local dead_after = refresh and config_value(d, 'dead_after_ms')
if refresh then due = int_text(now + math.floor(dead_after / 8)) end

-- the record and the barrier's fields that changed, in one write
local score_text = wave == 0 and step_text or int_text(score) -- (in wave 0, the step)
local line = format_line(score_text, now_text, wave_text, step_text, waiting, running, kv,
  admitted)
local fields = {engine, format_record(flag, due, line, older)}
if moved then
  behind = behind - 1
  fields[#fields + 1], fields[#fields + 2] = '.behind', behind
end
if score > pub and not h[3] then
  fields[#fields + 1], fields[#fields + 2] = '.since', now_text
end
if reap_due then
  fields[#fields + 1], fields[#fields + 2] = '.next_reap', now + math.floor(dead_after / 4)
end
redis.call('HSET', d.reports, unpack(fields))
if refresh then redis.call('ZADD', d.members, now_text, engine) end

local version = 0
if reap_due and #expire_engines(d, dead_after, now, 8) > 0 then
  version = publish_after_change(d, now)
end
if version == 0 and behind <= 0 and (pub < 0 or (flag == 'b' and score > pub)) then
  version = maybe_publish(d, now)
end
return {'accepted', version, wave, step}
