--[[
  report_7.lua: record one engine's step-tagged counts; publish the snapshot
  when this report completes the barrier.

  KEYS: the seven keys of common.lua (config, epoch, members, reports,
        meta, snapshot, channel).
  ARGV[1]  deployment name (goes into the snapshot JSON)
  ARGV[2]  "PUBLISH" or "SPUBLISH"
  ARGV[3]  epoch candidate: becomes the epoch if state was lost / is new;
           "r-..." when the caller had state before (see new_generation)
  ARGV[4]  engine id
  ARGV[5]  wave (0..2^20-1); ignored in tick mode
  ARGV[6]  step (0..2^32-1), or "tick": tag with the server's current tick
           floor(server_ms / tick_ms), shared by all independent engines; a tick
           is a score like any other, so it shows as (wave, step) =
           divmod(tick, 2^32) (e.g. wave 8 at 20 ms ticks): ordering is what counts
  ARGV[7]  waiting (0..1e9)
  ARGV[8]  running (0..1e9)
  ARGV[9]  kv_usage in [0, 1], or "" when unknown
  ARGV[10] admitted: comma-separated cumulative request counts received per
           API-server index ("" when not reported)

  Returns, in lockstep mode (a step given): the version of the snapshot this call
    published (0 if none), or -1 when the report was stale (older than this
    engine's latest: counted, nothing changed). A bare integer, because an array
    reply is a measurable part of a report's cost and the caller knows its tag.
  Returns, in tick mode: {status, version, wave, step}, status "accepted" or
    "stale", wave and step the tag the report was recorded under (as strings).
  redisbal.scripts.report_reply() reads both forms.
  Errors: "ERR redisbal: bad <field>: ..." before anything is written.
]]

local deployment, pubcmd = ARGV[1], ARGV[2]
local err = common_args(deployment, pubcmd, 10, 10)
if err then return fail(err) end
-- the engine id is checked below, before anything is written; an id with a record
-- was checked when the record was made (a hash field is read, no key is built)
local engine = ARGV[4]
local kv = 'null'
if ARGV[9] ~= '' then
  kv = ARGV[9]
  -- "0.4000" (what the reporters send), "1", "0": already JSON in [0, 1] with at
  -- most 4 decimals (a function library remembers them in kv_ok); anything else
  -- is parsed, checked and written as %.4f
  if kv_ok and kv_ok[kv] then -- passed before: nothing to check
  elseif find(kv, '^0%.%d%d?%d?%d?$') or kv == '1' or kv == '0' then
    if kv_ok then remember(kv_ok, kv, true) end
  else
    local v = #kv <= 24 and string.match(kv, '^%d*%.?%d+$') and tonumber(kv)
    if not v or v < 0 or v > 1 then return fail('bad kv_usage: ' .. tostring(ARGV[9])) end
    kv = string.format('%.4f', v) -- JSON whatever the spelling (".5", "00.5")
  end
end

-- The counts, the step and the admitted list. What the reporters send (canonical
-- decimals) passes one framed check: ",<step>,<waiting>,<running>,<admitted...>,"
-- holds only digits and commas (one anchored scan), no empty entry (",,") and no
-- leading zero (",0" followed by anything but ","), found with plain searches, which
-- are memchr-fast where an unanchored pattern costs ~150 instructions a character;
-- the upper bounds are compared as equal-width text. Step, waiting and running texts
-- that passed before are remembered by a function library (lua/library.lua: in
-- lockstep they repeat), and then only the admitted list is framed and checked.
-- That is what keeps the snapshot JSON: an admitted entry is not length-checked here
-- (that scan cost more than the rest of the check, and grows with the API servers;
-- the reporters refuse counts >= 10^15, and routers read a list whose sum reaches
-- that as not reported). Anything else takes the field-by-field checks, which name
-- the bad field (and accept spellings such as "007").
local waiting, running, adm, step_arg = ARGV[7], ARGV[8], ARGV[10], ARGV[6]
local tick = step_arg == 'tick'
local canonical = #adm <= 65536
if canonical then
  local framed
  local known = counts_ok and counts_ok[waiting] and counts_ok[running]
    and (tick or steps_ok[step_arg])
  if known then
    framed = adm ~= '' and ',' .. adm .. ','
  else
    canonical = #waiting <= 10 and #running <= 10 and #step_arg <= 10
    framed = canonical and ',' .. (tick and '0' or step_arg) .. ',' .. waiting .. ',' .. running ..
      ',' .. adm .. (adm == '' and '' or ',')
  end
  if framed then
    canonical = find(framed, '^[0-9,]+$') and not find(framed, ',,', 1, true)
    local z = canonical and find(framed, ',0', 1, true)
    while z do
      if byte(framed, z + 2) ~= 44 then canonical = false; break end -- 44 is ","
      z = find(framed, ',0', z + 2, true)
    end
  end
  if canonical and not known then
    canonical = (#waiting < 10 or waiting <= '1000000000') and (#running < 10 or running <= '1000000000')
      and (tick or #step_arg < 10 or step_arg <= '4294967295')
    if canonical and counts_ok then
      remember(counts_ok, waiting, #waiting < 10)
      remember(counts_ok, running, #running < 10)
      if not tick then remember(steps_ok, step_arg, #step_arg < 10) end
    end
  end
end
if not canonical then
  waiting = count_text(ARGV[7])
  if not waiting then return fail('bad waiting: ' .. tostring(ARGV[7])) end
  running = count_text(ARGV[8])
  if not running then return fail('bad running: ' .. tostring(ARGV[8])) end
  if adm ~= '' then
    local framed = ',' .. adm .. ','
    if #adm > 65536 or find(adm, '[^%d,]') or find(framed, ',,', 1, true)
      or find(framed, ',0%d') then
      return fail('bad admitted: expected comma-separated counts')
    end
  end
end

-- the time as text; as a number, and the settings, only where needed (in lockstep
-- mode that is a heartbeat refresh or a reap, every dead_after_ms / 8 or / 4)
local now_s = now_text()
local now, dead_after, tick_ms
local score, wave_s, step_s
if tick then
  now = tonumber(now_s)
  dead_after, tick_ms = report_config()
  score = math.floor(now / tick_ms)
  local w = math.floor(score / STEP_SPAN)
  wave_s, step_s = fmt(w), fmt(score - w * STEP_SPAN)
else
  local wave = ARGV[5] == '0' and 0 or int_arg(ARGV[5], 0, MAX_WAVE)
  if not wave then return fail('bad wave: ' .. tostring(ARGV[5])) end
  local step = canonical and (numbers[step_arg] or num(step_arg)) or int_arg(step_arg, 0, STEP_SPAN - 1)
  if not step then return fail('bad step: ' .. tostring(step_arg)) end
  score = wave * STEP_SPAN + step
  wave_s, step_s = int_text(ARGV[5], wave), canonical and step_arg or int_text(step_arg, step)
end

if HOT[engine] then return fail('bad engine_id: ' .. engine) end
-- the record and the barrier's hot fields, in one read (see common.lua)
-- (.pub is written with .epoch by new_generation: without it, the state is new or lost)
-- (.next_reap only when this report refreshes the heartbeat, below: a reply element less)
local h = redis.call('HMGET', K_REPORTS, engine, F_PUB, F_SINCE, F_BEHIND)
if not h[2] then
  cold() -- (common.lua: the helpers of the cold paths, defined on first use)
  if not new_generation(ARGV[3], tonumber(now_s)) then return fail('bad epoch candidate') end
  h = {false, '-1', false, '0'}
end
local pub = h[2] == '-1' and -1 or numbers[h[2]] or num(h[2]) or -1
local behind = h[4]
local rec = h[1]
-- the record's view for this path: flag, heartbeat due (text), latest score (nil if
-- none), position of the first report line (nil if none), by one anchored match
local flag, hb, last, pos = 'b', '', nil, nil
if rec then
  flag, hb, pos, last = string.match(rec, '^(.)(%d*)\n()(%d+)\t')
  if flag then
    last = numbers[last] or num(last)
  else
    flag, hb = sub(rec, 1, 1), sub(rec, 2)
  end
elseif not name_arg(engine) then
  return fail('bad engine_id: ' .. engine)
end

-- invariant 3: older than this engine's latest accepted report
if last and score < last then
  redis.call('HINCRBY', K_META, 'stale', 1)
  redis.call('HINCRBY', K_META, 'stale:' .. engine, 1)
  if tick then return {'stale', 0, wave_s, step_s} end
  return -1
end

-- The new record is built in one concatenation: head, this report's line, and the
-- tail of older lines to keep. Every intermediate long string would be hashed,
-- interned and collected by Lua, which is a measurable part of a report.
local moved, tail, generic = false, '', false
if not rec then
  -- a joiner: a barrier member, unless it is behind the published step, when
  -- it stays provisional so that it cannot hold the barrier back (invariant 5)
  if pub >= 0 and score <= pub then flag = 'p' end
  redis.call('HINCRBY', K_META, 'joined', 1)
elseif not last then
  -- registered, first report: it was counted as behind
  if flag == 'b' and score > pub then moved = true end
  if flag == 'p' and score > pub then flag = 'b' end
elseif score == last then
  -- same-step refresh (before/after step, or a retry): replace the newest report
  local nl = find(rec, '\n', pos, true)
  if nl then tail = sub(rec, nl) end
else
  if score <= pub then redis.call('HINCRBY', K_META, 'late', 1) end
  if flag == 'b' and last <= pub and score > pub then moved = true end
  if flag == 'p' and score > pub then flag = 'b' end
  if last <= pub and score > pub then
    -- the usual case: the previous report is the newest at or before pub, so it
    -- is the only one to keep besides this one (pos - 1 is the newline before it)
    local nl = find(rec, '\n', pos, true)
    tail = nl and sub(rec, pos - 1, nl - 1) or sub(rec, pos - 1)
  else
    tail, generic = sub(rec, pos - 1), true -- pruned below
  end
end
-- hb is when the heartbeat in members is next due (ms, same width as now_s)
local refresh = not rec or #hb ~= #now_s or now_s >= hb
-- Opportunistic expiry is considered when a heartbeat is refreshed: every live
-- engine refreshes every dead_after_ms / 8, so some report checks at least that
-- often while any engine reports, and .next_reap spaces the reaps dead_after_ms / 4.
local reap_due = false
if refresh then
  local next_reap = redis.call('HGET', K_REPORTS, F_NEXT_REAP)
  reap_due = not next_reap or #next_reap ~= #now_s or now_s >= next_reap
end
if refresh and not dead_after then -- (a reap is only due on a refresh)
  now = tonumber(now_s)
  dead_after, tick_ms = report_config()
end
if refresh then hb = fmt(now + math.floor(dead_after / 8)) end
local adm_open, adm_close = '', '}'
if adm ~= '' then adm_open, adm_close = ',"adm":[', ']}' end
local record = flag .. hb .. '\n' ..
  (score < STEP_SPAN and ARGV[6] == step_s and step_s or fmt(score)) .. '\t' .. now_s ..
  '\t{"wave":' .. wave_s .. ',"step":' .. step_s .. ',"waiting":' .. waiting .. ',"running":' ..
  running .. ',"kv":' .. kv .. ',"t":' .. now_s .. adm_open .. adm .. adm_close .. tail
if generic then
  cold()
  local at = #flag + #hb + 2
  record = sub(record, 1, at - 1) .. prune(sub(record, at), pub)
end
-- the record and the hot fields that changed, in one write
local since = score > pub and not h[3]
behind = numbers[behind] or num(behind) or (moved and 1 or 0)
if moved then behind = behind - 1 end
-- .behind goes to HSET as text in a function library (lua/library.lua), else as
-- the number (Redis formats it)
if since or reap_due then
  local set = {engine, record}
  if moved then
    set[#set + 1] = F_BEHIND
    set[#set + 1] = int_texts and (int_texts[behind] or itext(behind)) or behind
  end
  if since then set[#set + 1] = F_SINCE; set[#set + 1] = now_s end
  if reap_due then
    set[#set + 1] = F_NEXT_REAP
    set[#set + 1] = fmt(now + math.floor(dead_after / 4))
  end
  redis.call('HSET', K_REPORTS, unpack(set))
elseif moved then
  redis.call('HSET', K_REPORTS, engine, record, F_BEHIND,
    int_texts and (int_texts[behind] or itext(behind)) or behind)
else
  redis.call('HSET', K_REPORTS, engine, record)
end
if refresh then redis.call('ZADD', K_MEMBERS, now_s, engine) end

-- opportunistic expiry, at most every dead_after_ms / 4, so that the barrier
-- never waits for a dead engine even without a coordinator
local version = 0
local cfg
if reap_due then
  cold()
  cfg = config()
  if #reap(cfg, now, 8) > 0 then version = publish_after_change(cfg, now, deployment, pubcmd) end
end
if version == 0 and behind <= 0 and (pub < 0 or (flag == 'b' and score > pub)) then
  cold()
  version = maybe_publish(cfg or config(), now or tonumber(now_s), deployment, pubcmd)
end
if tick then return {'accepted', version, wave_s, step_s} end
return version
