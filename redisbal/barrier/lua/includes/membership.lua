--[[
  membership: engines leaving, by their own call (leave.lua) or by expiry
  (reap.lua, and reports on the way).

  An engine's heartbeat (its score in the members zset) is refreshed every
  dead_after_ms / 8, not on every report, so expiry checks the record's own
  last report time before removing an engine.
]]
--- @include "args"
--- @include "deployment"
--- @include "record"

local MAX_RECENT = 64 -- removed engines remembered for `redisbal status`

-- Remove an engine (why: "left" or "expired"): its record, its heartbeat and
-- its place in the barrier count; count it, note it for the next snapshot's
-- "gone" and in meta's "recent" ("<id> <why> <ms> <incarnation>" lines, newest
-- first, MAX_RECENT at most). Returns 1 if it was there, else 0.
local function remove_engine(d, engine, why, now)
  local text = redis.call('HGET', d.reports, engine)
  local removed = redis.call('ZREM', d.members, engine)
  local inc = '-'
  if text then
    redis.call('HDEL', d.reports, engine)
    local rec = parse_record(text)
    inc = rec.inc
    if rec.flag == 'b' and (not rec.score or rec.score <= published_score(d)) then
      redis.call('HINCRBY', d.reports, '.behind', -1)
    end
  end
  redis.call('HDEL', d.meta, 'stale:' .. engine, 'suspect:' .. engine)
  if removed == 0 and not text then return 0 end
  redis.call('HINCRBY', d.meta, why, 1)
  local recent = engine .. ' ' .. why .. ' ' .. int_text(now) .. ' ' .. inc
  local kept = redis.call('HGET', d.meta, 'recent')
  if kept and kept ~= '' then
    local _, lines = string.gsub(kept, '\n', '')
    if lines + 1 >= MAX_RECENT then kept = string.match(kept, '^(.*)\n[^\n]*$') end
    recent = recent .. '\n' .. kept
  end
  redis.call('HSET', d.meta, 'recent', recent)
  local gone = redis.call('HGET', d.meta, 'gone')
  local item = '"' .. engine .. '":"' .. why .. '"'
  if gone and gone ~= '' then item = gone .. ',' .. item end
  redis.call('HSET', d.meta, 'gone', item)
  return 1
end

-- Expire up to limit engines whose last report is older than dead_after ms;
-- a candidate whose record shows a recent report gets its heartbeat corrected
-- instead. Returns the expired ids.
local function expire_engines(d, dead_after, now, limit)
  -- Nothing reached this deployment for longer than dead_after_ms (Redis down,
  -- paused, or failed over; otherwise a coordinator and every engine expire at
  -- least every dead_after_ms / 4): the engines could not report, so silence
  -- says nothing about them. Give them dead_after_ms from now before judging.
  local m = redis.call('HMGET', d.meta, 'reaped_at', 'hold_until')
  redis.call('HSET', d.meta, 'reaped_at', int_text(now))
  local last = tonumber(m[1])
  if last and now - last > dead_after then
    redis.call('HSET', d.meta, 'hold_until', int_text(now + dead_after))
    return {}
  end
  if m[2] and now < (tonumber(m[2]) or 0) then return {} end
  local candidates = redis.call('ZRANGEBYSCORE', d.members, '-inf',
    '(' .. int_text(now - dead_after), 'LIMIT', 0, limit)
  local dead = {}
  for _, engine in ipairs(candidates) do
    local text = redis.call('HGET', d.reports, engine)
    local line = text and parse_record(text).line
    local reported = line and line_ms(line) or 0
    if now - reported < dead_after then
      redis.call('ZADD', d.members, reported, engine)
    else
      remove_engine(d, engine, 'expired', now)
      dead[#dead + 1] = engine
    end
  end
  return dead
end
