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
     "suspect": {id: ms its ejection has left, ...} (not to be routed to),
     "probing": [id, ...] (ejection over, not cleared yet: one request at a
        time per router; suspect.lua, recovered.lua),
     "time_ms": server ms, then the engines' counts in one of two forms:
  full, below compact_from engines with counts (a deployment setting):
     "engines": {id: report json (includes/record.lua), ...}}
  compact, from compact_from engines with counts on:
     "roster": R (meta "roster": it goes up when the list of ids and incs
        differs from the previous compact publish's, kept as text in the
        reports hash field ".roster"; a new epoch or a full publish clears it),
     "ids": [id, ...], "incs": [incarnation or "-", ...] (same order),
     "counts": [waiting, running, kv, age ms (time_ms - the report's t), ...]
        (4 per engine, in the order of ids)}
     The key always has ids and incs; the channel message only when R went up
     in this publish. (The order is the reports hash's when R goes up, then
     kept while the roster holds.)
  redisbal/barrier/snapshot.py reads it; docs/DESIGN.md describes it.
]]
--- @include "args"
--- @include "deployment"
--- @include "score"
--- @include "record"

-- A snapshot's header fields, up to time_ms (the engines' part follows).
local function snapshot_head(d, epoch, version, cut, forced, laggards, gone, joining, stalled,
    suspect, probing, now)
  local wave, step = from_score(cut)
  return '{"deployment":"' .. d.name .. '","epoch":"' .. epoch .. '","version":' .. version ..
    ',"wave":' .. int_text(wave) .. ',"step":' .. int_text(step) ..
    ',"forced":' .. (forced and 'true' or 'false') ..
    ',"laggards":{' .. table.concat(laggards, ',') .. '},"gone":{' .. gone ..
    '},"joining":[' .. table.concat(joining, ',') .. '],"stalled":{' ..
    table.concat(stalled, ',') .. '},"suspect":{' .. table.concat(suspect, ',') ..
    '},"probing":[' .. table.concat(probing, ',') .. '],"time_ms":' .. int_text(now)
end

-- The order of the previous roster (text: ids, then incs) when ids and incs
-- hold the same engines and incarnations in another order: order[p] is the
-- index in ids of its p-th engine. Nil when they differ. (A rehash of the
-- reports hash changes the order HGETALL gives; that is no roster change.)
local function roster_order(old, ids, incs)
  local nl = string.find(old, '\n', 1, true)
  local at, order, p = {}, {}, 0
  for i = 1, #ids do at[ids[i]] = i end
  for id in string.gmatch(string.sub(old, 1, nl - 1), '[^",]+') do
    p = p + 1
    order[p] = at[id]
    if not order[p] then return nil end
  end
  if p ~= #ids then return nil end
  p = 0
  for inc in string.gmatch(string.sub(old, nl + 1), '[^",]+') do
    p = p + 1
    if incs[order[p]] ~= inc then return nil end
  end
  return order
end

-- The compact form's parts for the engines ids[i] with report JSON jsons[i], at
-- server ms now; old: the previous roster text (or nil). Returns the roster
-- text (ids, then incs: old when only the order differs, and then in old's
-- order), the "ids" and "incs" fields, and the "counts" field.
local function compact_parts(ids, jsons, now, old)
  local counts, incs, j = {}, {}, 0
  for i = 1, #ids do
    local waiting, running, kv, t, inc = json_counts(jsons[i])
    local age = now - tonumber(t)
    if age < 0 then age = 0 end
    counts[j + 1], counts[j + 2], counts[j + 3], counts[j + 4] = waiting, running, kv, age
    j = j + 4
    incs[i] = inc or '-'
  end
  local ids_text, incs_text = table.concat(ids, '","'), table.concat(incs, '","')
  local roster = ids_text .. '\n' .. incs_text
  local order = old and roster ~= old and roster_order(old, ids, incs)
  if order then -- the same roster in the hash's new order: keep the old one's
    local moved = {}
    for p = 1, #order do
      local from, to = 4 * order[p] - 4, 4 * p - 4
      moved[to + 1], moved[to + 2] = counts[from + 1], counts[from + 2]
      moved[to + 3], moved[to + 4] = counts[from + 3], counts[from + 4]
    end
    counts, roster = moved, old
    local nl = string.find(old, '\n', 1, true)
    ids_text, incs_text = string.sub(old, 1, nl - 1), string.sub(old, nl + 1)
  end
  local with_ids = #ids == 0 and ',"ids":[],"incs":[]' or
    ',"ids":["' .. ids_text .. '"],"incs":["' .. incs_text .. '"]'
  return roster, with_ids, ',"counts":[' .. table.concat(counts, ',') .. ']}'
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
  local stalled, suspect, probing = {}, {}, {}
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
      elseif suspect_until ~= 0 then
        probing[#probing + 1] = '"' .. ids[n] .. '"'
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
  -- the engines with counts at the cut (k of them) and their report JSON
  local cut_ids, cut_jsons, joining, laggards, laggard_ids = {}, {}, {}, {}, {}
  local k, behind, ahead = 0, 0, false
  for i = 1, n do
    local id, score, json = ids[i], scores[i], jsons[i]
    if score and score > cut then -- past the cut: its newest report at or before it
      local line = line_at_or_before(parse_record(texts[i]), cut)
      json = line and line_json(line)
    end
    if json then
      k = k + 1
      cut_ids[k], cut_jsons[k] = id, json
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
  local m = redis.call('HMGET', d.meta, 'gone', 'roster')
  local head = snapshot_head(d, barrier['.epoch'] or '', version, cut, forced, laggards,
    m[1] or '', joining, stalled, suspect, probing, now)
  local json, message
  local hot = {'.pub', int_text(cut), '.behind', behind} -- the barrier fields it sets
  if k >= config_value(d, 'compact_from') then
    local roster, with_ids, counts = compact_parts(cut_ids, cut_jsons, now, barrier['.roster'])
    local r, changed = m[2], not m[2] or roster ~= barrier['.roster']
    if changed then
      r = redis.call('HINCRBY', d.meta, 'roster', 1)
      hot[5], hot[6] = '.roster', roster
    end
    head = head .. ',"roster":' .. r
    json = head .. with_ids .. counts
    message = changed and json or head .. counts -- ids only with a new roster
  else
    local engines = {}
    for i = 1, k do engines[i] = '"' .. cut_ids[i] .. '":' .. cut_jsons[i] end
    json = head .. ',"engines":{' .. table.concat(engines, ',') .. '}}'
    message = json
    -- the next compact publish names its roster again
    if barrier['.roster'] then redis.call('HDEL', d.reports, '.roster') end
  end
  redis.call('SET', d.snapshot, json)
  -- SPUBLISH exists from Redis 7.0, which also added redis.REDIS_VERSION_NUM: a
  -- 6.2 cluster gets PUBLISH (routers subscribe the same way: router.py)
  local pubcmd = d.pubcmd
  if pubcmd == 'SPUBLISH' and not redis.REDIS_VERSION_NUM then pubcmd = 'PUBLISH' end
  redis.call(pubcmd, d.channel, message)
  redis.call('HINCRBY', d.meta, forced and 'forced' or 'published', 1)
  redis.call('HSET', d.meta, 'pub_ms', int_text(now), 'gone', '')
  redis.call('HSET', d.reports, unpack(hot))
  if cut > pub then redis.call('HSET', d.reports, '.pub_at', int_text(now)) end
  if ahead then
    redis.call('HSET', d.reports, '.since', int_text(now))
  else
    redis.call('HDEL', d.reports, '.since')
  end
  return version, laggard_ids
end
