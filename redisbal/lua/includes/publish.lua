--[[
  publish: make and publish a snapshot, a consistent cut of the deployment.

  The cut at score S holds every engine's newest report at or before S, so a
  snapshot never mixes a report from before a step with one from after it.
  The snapshot (KEYS[6], and the message on the channel) is one JSON object:
    {"deployment": name, "epoch": id, "version": N (counts up per epoch),
     "wave": W, "step": S (the cut), "forced": bool (stall guard, force.lua),
     "laggards": {id: ms since its last report, ...} (forced only),
     "gone": {id: "expired"|"left", ...} (since the previous snapshot),
     "joining": [id, ...] (members without a report at or before the cut),
     "stalled": {id: ms since its last progress, ...} (not to be routed to),
     "suspect": {id: ms the mark has left, ...} (not to be routed to),
     "time_ms": server ms, "engines": {id: report json (includes/record.lua), ...}}
  redisbal/snapshot.py reads it; docs/DESIGN.md describes it.
]]
--- @include "args"
--- @include "deployment"
--- @include "score"
--- @include "record"

local function snapshot_json(d, epoch, version, cut, forced, laggards, gone, joining, stalled,
    suspect, now, engines)
  local wave, step = from_score(cut)
  return '{"deployment":"' .. d.name .. '","epoch":"' .. epoch .. '","version":' .. version ..
    ',"wave":' .. int_text(wave) .. ',"step":' .. int_text(step) ..
    ',"forced":' .. (forced and 'true' or 'false') ..
    ',"laggards":{' .. table.concat(laggards, ',') .. '},"gone":{' .. gone ..
    '},"joining":[' .. table.concat(joining, ',') .. '],"stalled":{' ..
    table.concat(stalled, ',') .. '},"suspect":{' .. table.concat(suspect, ',') ..
    '},"time_ms":' .. int_text(now) .. ',"engines":{' .. table.concat(engines, ',') .. '}}'
end

-- The score to cut at: the lowest newest score of the barrier members, in mode
-- "barrier"; in mode "forced" the lowest among those past pub. Nil when no
-- member qualifies. (flags and scores: per engine, as read_newest returns them.)
local function cut_score(flags, scores, mode, pub)
  local cut = nil
  for i = 1, #flags do
    local score = scores[i]
    if flags[i] == 'b' and score and (mode == 'barrier' or score > pub)
      and (not cut or score < cut) then
      cut = score
    end
  end
  return cut
end

-- Publish the cut chosen by mode:
--   "barrier"  every member has reported past pub: cut at the lowest newest
--              score of the members (nothing when no member has reported);
--   "forced"   the stall guard: cut at the lowest newest score among the
--              members past pub; the members still at or before pub are the
--              laggards, named in the snapshot with the age of their report;
--   a number   cut at that score (a republish after a change, idle heartbeat).
-- Then .pub is the cut, .behind counts the members at or before it, and .since
-- is set when some member is already past it (the next barrier is under way).
-- Returns the version published (0 if none) and the laggards' ids.
local function publish(d, mode, now)
  local flat = redis.call('HGETALL', d.reports)
  -- per engine i: its id, record text, flag, newest score and that report's JSON;
  -- the stalled and suspect engines as the snapshot lists them
  local ids, texts, flags, scores, jsons, barrier = {}, {}, {}, {}, {}, {}
  local stalled, suspect = {}, {}
  local n = 0
  for i = 1, #flat, 2 do
    if is_engine_field(flat[i]) then
      n = n + 1
      ids[n], texts[n] = flat[i], flat[i + 1]
      local progress, suspect_until
      flags[n], scores[n], jsons[n], progress, suspect_until = read_newest(texts[n])
      if flags[n] == 's' then
        stalled[#stalled + 1] = '"' .. ids[n] .. '":' .. int_text(now - tonumber(progress))
      end
      if suspect_until > now then
        suspect[#suspect + 1] = '"' .. ids[n] .. '":' .. int_text(suspect_until - now)
      end
    else
      barrier[flat[i]] = flat[i + 1]
    end
  end
  local pub = tonumber(barrier['.pub'] or '-1') or -1
  local cut = mode
  if type(mode) ~= 'number' then cut = cut_score(flags, scores, mode, pub) end
  if not cut or (mode == 'forced' and cut <= pub) then return 0, {} end

  local forced = mode == 'forced'
  local engines, joining, laggards, laggard_ids = {}, {}, {}, {}
  local behind, ahead = 0, false
  for i = 1, n do
    local id, score, json = ids[i], scores[i], jsons[i]
    if score and score > cut then -- past the cut: its newest report at or before it
      local line = line_at_or_before(parse_record(texts[i]), cut)
      json = line and line_json(line)
    end
    if json then
      engines[#engines + 1] = '"' .. id .. '":' .. json
    else
      joining[#joining + 1] = '"' .. id .. '"'
    end
    if flags[i] == 'b' then
      if not score or score <= cut then behind = behind + 1 else ahead = true end
      if forced and score and score <= pub then
        local age = now - line_ms(parse_record(texts[i]).line)
        laggards[#laggards + 1] = '"' .. id .. '":' .. int_text(age)
        laggard_ids[#laggard_ids + 1] = id
      end
    end
  end

  local version = redis.call('HINCRBY', d.meta, 'version', 1)
  local gone = redis.call('HGET', d.meta, 'gone') or ''
  local json = snapshot_json(d, barrier['.epoch'] or '', version, cut, forced, laggards, gone,
    joining, stalled, suspect, now, engines)
  redis.call('SET', d.snapshot, json)
  -- SPUBLISH exists from Redis 7.0, which also added redis.REDIS_VERSION_NUM: a
  -- 6.2 cluster gets PUBLISH (routers subscribe the same way: router.py)
  local pubcmd = d.pubcmd
  if pubcmd == 'SPUBLISH' and not redis.REDIS_VERSION_NUM then pubcmd = 'PUBLISH' end
  redis.call(pubcmd, d.channel, json)
  redis.call('HINCRBY', d.meta, forced and 'forced' or 'published', 1)
  redis.call('HSET', d.meta, 'pub_ms', int_text(now), 'gone', '')
  redis.call('HSET', d.reports, '.pub', int_text(cut), '.behind', behind)
  if cut > pub then redis.call('HSET', d.reports, '.pub_at', int_text(now)) end
  if ahead then
    redis.call('HSET', d.reports, '.since', int_text(now))
  else
    redis.call('HDEL', d.reports, '.since')
  end
  return version, laggard_ids
end
