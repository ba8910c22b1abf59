--[[
  report: record one engine's counts for one step, and publish the snapshot
  when this report completes the barrier (or changed what routers must know).

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
  ARGV[11] optional: the reporting process's incarnation, "-" when not named
           (the default; includes/incarnation.lua)
  ARGV[12] optional: "1" (the default) when the engine's loop made this report,
           "0" for a heartbeat re-sending unchanged counts: progress, not pulse

  Returns {status, version, wave, step[, incarnation]}:
    status   "accepted"; "stale": older than this engine's latest report
             (counted, nothing else changed); "conflict": from an incarnation
             older than the engine's record (a replaced process, or two
             processes under one engine id): refused and counted, and the
             record's incarnation is the fifth element
    version  of the snapshot this call published, 0 if none
    wave, step  the tag the report was recorded under (in tick mode, the tick)
  Errors: "redisbal: bad <field>: ..." before anything is written.

  On the way, a report refreshes the engine's heartbeat every dead_after_ms / 8
  and then expires dead engines at most every dead_after_ms / 4, so the barrier
  never waits for a dead engine even without a coordinator.

  Lifecycle (docs/DESIGN.md, "Engine lifecycle"):
  - restart: a later incarnation replaces the record (a leave and a join in one
    step). A restarted lockstep engine, or one whose process started after the
    published step was reached, whose step is at or behind the published one
    starts a new step sequence right after it (its offset), shared by the
    engines that do so within dead_after_ms of each other while it keeps them
    at or behind the next step, so that a group restarting together stays
    aligned and publishes unforced snapshots again;
  - stall: a heartbeat of an engine with work queued or running whose last
    progress is stall_after_ms old marks it stalled (not waited for, not
    routed to); its next progress brings it back;
  - suspect (suspect.lua): cleared by the engine's next progress.
]]
--- @include "args"
--- @include "deployment"
--- @include "time"
--- @include "score"
--- @include "record"
--- @include "incarnation"
--- @include "generation"
--- @include "barrier"
--- @include "membership"

local d, err = open_deployment(KEYS, ARGV, 10, 12)
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
local inc = incarnation_arg(ARGV[11] or '-')
if not inc then return fail('bad incarnation: ' .. ARGV[11]) end
local progress = ARGV[12] or '1'
if progress ~= '1' and progress ~= '0' then return fail('bad progress: ' .. progress) end
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
local raw = to_score(wave, step) -- the engine's own order; + the record's offset: ours

-- the engine's record and the barrier's fields, in one read
local h = redis.call('HMGET', d.reports, engine, '.pub', '.since', '.behind')
if not h[2] then -- no .pub: the state is new or was lost
  if not new_generation(d, ARGV[3], now) then return fail('bad epoch candidate') end
  h = {false, '-1', false, '0'}
end
local pub = tonumber(h[2])
local behind = tonumber(h[4]) or 0
local old_behind = behind
local rec = h[1] and parse_record(h[1])
local changed = false -- routers must hear of this report at once (republish)
local restarted = false

-- a member counts in .behind while its newest report is at or before pub
local function counted(flag, score)
  return flag == 'b' and (not score or score <= pub)
end

if rec and inc ~= '-' and rec.inc ~= '-' and inc ~= rec.inc then
  if started_before(inc, rec.inc) then -- a process older than the record's: refused
    redis.call('HINCRBY', d.meta, 'conflicts', 1)
    redis.call('HSET', d.meta, 'conflict:' .. engine, now_text .. ' ' .. inc .. ' ' .. rec.inc)
    return {'conflict', 0, wave, step, rec.inc}
  end
  -- a restart: the old record leaves, this report joins
  if counted(rec.flag, rec.score) then behind = behind - 1 end
  redis.call('HINCRBY', d.meta, 'restarted', 1)
  redis.call('HDEL', d.meta, 'stale:' .. engine, 'suspect:' .. engine)
  rec, changed, restarted = nil, true, true
end

-- the offset into the deployment's order: the record's, or a new step sequence
-- for a lockstep process whose counter cannot be part of the published one: a
-- restart, or a process started after pub was reached. The engines that do so
-- within dead_after_ms of each other share one sequence (a group restarting
-- together stays aligned), as long as it keeps them at or behind pub + 1. A
-- process that was part of the published sequence (a group member joining a
-- few steps late, an engine that comes back) keeps its steps: provisional.
local offset = rec and rec.offset or '0'
if (not rec or not rec.score) and inc ~= '-' and not tick_mode and pub >= 0 and raw <= pub then
  local r = redis.call('HMGET', d.reports, '.rebase', '.rebase_ms', '.pub_at')
  local shared = tonumber(r[1])
  if shared and now - tonumber(r[2]) < config_value(d, 'dead_after_ms')
    and shared + raw <= pub + 1 then
    offset = r[1]
  elseif restarted or started_ms(inc) >= (tonumber(r[3]) or now) then
    offset = int_text(pub + 1 - raw)
    redis.call('HSET', d.reports, '.rebase', offset, '.rebase_ms', now_text)
  end
end
local score = raw + tonumber(offset)
if score >= 2 ^ 53 then return fail('bad step: past the order a number holds; start a new epoch') end

-- older than this engine's newest accepted report: stale
if rec and rec.score and score < rec.score then
  redis.call('HINCRBY', d.meta, 'stale', 1)
  redis.call('HINCRBY', d.meta, 'stale:' .. engine, 1)
  return {'stale', 0, wave, step}
end

-- the new record's head and its older lines
local flag, due, older, last_progress, suspect = 'b', '0', '', now_text, '0'
if not rec then
  -- a joiner: a barrier member, unless it is behind the published step, when it
  -- stays provisional so that it cannot hold the barrier back
  if score < pub then flag = 'p' end
  redis.call('HINCRBY', d.meta, 'joined', 1)
else
  if counted(rec.flag, rec.score) then behind = behind - 1 end
  flag, due, older = rec.flag, rec.due, older_to_keep(rec, score, pub)
  if rec.inc ~= '-' and inc == '-' then inc = rec.inc end
  if progress == '0' and rec.progress ~= '0' then last_progress = rec.progress end
  if rec.suspect > now then -- cleared by progress, else kept
    if progress == '1' then
      redis.call('HDEL', d.meta, 'suspect:' .. engine)
      changed = true
    else
      suspect = int_text(rec.suspect)
    end
  end
  if flag == 's' then
    if progress == '1' then -- it stepped again
      flag, changed = score >= pub and 'b' or 'p', true
    end
  elseif score >= pub then
    flag = 'b' -- a provisional joiner that reaches pub joins the barrier
  end
  if rec.score and score ~= rec.score and score <= pub then
    redis.call('HINCRBY', d.meta, 'late', 1)
  end
  -- a heartbeat of an engine with work whose loop has not progressed: stalled
  if progress == '0' and flag ~= 's' and (waiting ~= '0' or running ~= '0')
    and now - tonumber(last_progress) >= config_value(d, 'stall_after_ms') then
    flag, changed = 's', true
    redis.call('HINCRBY', d.meta, 'stalled', 1)
  end
end
if counted(flag, score) then behind = behind + 1 end

-- the heartbeat in members is refreshed every dead_after_ms / 8, and dead
-- engines are expired on a refresh at most every dead_after_ms / 4
local refresh = now >= (tonumber(due) or 0)
local reap_due = refresh and now >= (tonumber(redis.call('HGET', d.reports, '.next_reap')) or 0)
local dead_after = refresh and config_value(d, 'dead_after_ms')
if refresh then due = int_text(now + math.floor(dead_after / 8)) end

-- the record and the barrier's fields that changed, in one write
local score_text = score == raw and wave == 0 and step_text or int_text(score)
local line = format_line(score_text, now_text, wave_text, step_text, waiting, running, kv,
  admitted, inc)
local head = format_head(flag, due, inc, offset, last_progress, suspect)
local fields = {engine, format_record(head, line, older)}
if behind ~= old_behind then
  fields[#fields + 1], fields[#fields + 2] = '.behind', behind
end
if flag == 'b' and score > pub and not h[3] then
  fields[#fields + 1], fields[#fields + 2] = '.since', now_text
end
if reap_due then
  fields[#fields + 1], fields[#fields + 2] = '.next_reap', now + math.floor(dead_after / 4)
end
redis.call('HSET', d.reports, unpack(fields))
if refresh then redis.call('ZADD', d.members, now_text, engine) end

if reap_due and #expire_engines(d, dead_after, now, 8) > 0 then changed = true end
local version = 0
if changed then
  version = publish_after_change(d, now)
elseif behind <= 0 and (pub < 0 or (flag == 'b' and score > pub)) then
  version = maybe_publish(d, now)
end
return {'accepted', version, wave, step}
