--[[
  common.lua: shared by every redisbal script (redisbal/scripts.py prepends it).

  Every script gets the same seven KEYS, all of one deployment and so of one
  hash slot (they share the hash tag "{<deployment>}"):
    KEYS[1] config    HASH   settings (dead_after_ms, stall_ms, tick_ms, ...),
                             and the coordinator lease (lease_owner, fence, ...)
    KEYS[2] epoch     STRING id of this state generation (also reports[".epoch"])
    KEYS[3] members   ZSET   engine -> server ms of its heartbeat (liveness)
    KEYS[4] reports   HASH   engine -> its record (below), and the barrier's hot
                             fields .epoch, .pub, .behind, .since, .next_reap
    KEYS[5] meta      HASH   version, counters, and what only the cold paths use
    KEYS[6] snapshot  STRING latest snapshot JSON
    KEYS[7] channel   the pub/sub channel; passed in KEYS, not built here, so
                      that Redis Cluster sees its slot (it is the same slot)

  A (wave, step) pair is one number, its score: wave * 2^32 + step (< 2^52,
  exact in a double). reports[".pub"] is the score of the last published
  snapshot (-1 before the first one of an epoch); "pub" below.

  The barrier's hot fields live in the reports hash next to the records (engine
  ids start with a letter or digit, so ".x" is never an engine) because a report
  then reads everything it needs in one HMGET and writes it in one HSET: with
  TIME, three Redis commands per report, a large part of what a report costs
  (.next_reap only when the report also refreshes its heartbeat).

  An engine's record: a head line "<flag><ms when its heartbeat is due>", then its accepted
  reports newest first, one per line: "<score>\t<report ms>\t<json>", where
  <json> is the engine's snapshot fragment. flag "b": a barrier member; "p": a
  provisional joiner (behind the published step: in snapshots, not waited
  for). We keep every report newer than pub plus the newest one at or before
  pub: exactly what any future cut can need.

  The barrier is a counter, not a scan: .behind counts barrier members
  whose latest report is at or before pub (registered engines that have not
  reported count too). A report that moves a member past pub decrements it;
  when it reaches 0 every member has reported a newer step, and the snapshot
  for the lowest of their steps is published (O(N) once per step; O(1) per
  report). The heartbeat in members is refreshed every dead_after_ms / 8, not
  on every report; expiry checks the record's own report time before removing.
  Millisecond times on the report path are compared as equal-width text, which
  saves a strtod per field (a report's cost is mostly such small things).
]]

-- What a function library keeps between calls besides numbers and key_names: texts
-- that passed the report's checks, and texts it would otherwise format. Filled in
-- by lua/library.lua, which a library runs after this file; nil in an EVAL script,
-- which starts from nothing on every call, so the code that reads them skips them
-- there and costs what it did before (each closure, and each local it captures,
-- would be paid on every EVAL call). Declared first: a closure finds each upvalue
-- by walking the captured locals declared after it, on every EVAL call.
local kv_ok, counts_ok, steps_ok, id_keys, int_texts, remember, itext

local STEP_SPAN = 4294967296
local MAX_WAVE = 1048575
local MAX_COUNT = 1000000000
local MAX_HISTORY = 256
local NAME_PATTERN = '^%w[%w_.%-]*$'

-- the barrier's hot fields in the reports hash (not engine ids: see above)
local F_EPOCH, F_PUB, F_BEHIND, F_SINCE, F_NEXT_REAP = '.epoch', '.pub', '.behind', '.since', '.next_reap'
local HOT = {[F_EPOCH] = true, [F_PUB] = true, [F_BEHIND] = true, [F_SINCE] = true, [F_NEXT_REAP] = true}

-- Bound by bind() at the start of every call: an EVAL script runs this file on each
-- call, but a function library (Redis 7, see redisbal/scripts.py) runs it once at
-- FUNCTION LOAD, so nothing here may read KEYS or ARGV outside bind().
local K_CONFIG, K_EPOCH, K_MEMBERS, K_REPORTS, K_META, K_SNAPSHOT, K_CHANNEL
local KEYS_IN, ARGV_IN
-- string.find, .byte and .sub as upvalues: the report path calls them a dozen times,
-- and each string.find is a global and a field lookup (bound in bind(): a function
-- library has no string table while it loads)
local find, byte, sub

local function bind(keys, argv)
  KEYS_IN, ARGV_IN = keys, argv
  if not sub then find, byte, sub = string.find, string.byte, string.sub end -- once in a library
  K_CONFIG, K_EPOCH, K_MEMBERS, K_REPORTS = keys[1], keys[2], keys[3], keys[4]
  K_META, K_SNAPSHOT, K_CHANNEL = keys[5], keys[6], keys[7]
end

local function fail(msg)
  return redis.error_reply('ERR redisbal: ' .. msg)
end

local function fmt(n)
  return string.format('%.0f', n)
end

-- server time in ms, as (number, string)
local function now_ms()
  local t = redis.call('TIME')
  local s = t[1] .. string.sub('00000' .. t[2], -6, -4)
  return tonumber(s), s
end

-- server time in ms, as text only (the report path needs the number rarely)
local function now_text()
  local t = redis.call('TIME')
  local us = t[2]
  if #us == 6 then return t[1] .. string.sub(us, 1, 3) end -- no padding string to make
  return t[1] .. string.sub('00000' .. us, -6, -4)
end

-- nil when s is not a whole number in [lo, hi]
local function int_arg(s, lo, hi)
  if type(s) ~= 'string' or #s > 16 or not find(s, '^%-?%d+$') then return nil end
  local n = tonumber(s)
  if n == nil or n < lo or n > hi then return nil end
  return n
end

-- a count in 0..MAX_COUNT as canonical JSON text, or nil (no tonumber unless needed)
local function count_text(s)
  if type(s) ~= 'string' or #s > 10 or not find(s, '^%d+$') then return nil end
  if #s == 10 and tonumber(s) > MAX_COUNT then return nil end
  if #s > 1 and string.byte(s, 1) == 48 then return fmt(tonumber(s)) end
  return s
end

-- the canonical decimal text of a validated whole number (no sprintf when s is it)
local function int_text(s, n)
  if s == '0' or (n ~= 0 and byte(s, 1) ~= 48 and byte(s, 1) ~= 45) then return s end
  return fmt(n)
end

local function name_arg(s)
  if type(s) ~= 'string' or #s < 1 or #s > 64 or not find(s, NAME_PATTERN) then
    return nil
  end
  return s
end

local function config()
  local c = redis.call('HMGET', K_CONFIG, 'dead_after_ms', 'stall_ms', 'tick_ms',
    'join_grace_ms', 'idle_publish_ms')
  return {
    dead_after_ms = tonumber(c[1]) or 5000,
    stall_ms = tonumber(c[2]) or 250,
    tick_ms = tonumber(c[3]) or 20,
    join_grace_ms = tonumber(c[4]) or 1000,
    idle_publish_ms = tonumber(c[5]) or 1000,
  }
end

-- The two settings every report needs, without the table: dead_after_ms, tick_ms.
-- A function library remembers the last text it parsed for each (Lua strings are
-- interned, so the comparison is a pointer comparison): no strtod per report.
local seen_da, seen_da_n, seen_tick, seen_tick_n = nil, 5000, nil, 20

-- tonumber for the texts a report parses (step, previous step, .pub, .behind),
-- memoised: in lockstep every engine sends the same few texts, so a function
-- library mostly finds them here instead of running strtod. Bounded: reset past 256.
-- (An EVAL script starts from an empty table on every call: it parses directly.)
-- The hot paths look in numbers first ("numbers[t] or num(t)"): a call costs more
-- than the lookup.
local numbers, numbers_n = {}, 0
local LIBRARY = false -- set to true by a function library (lua/library.lua, after this file)

local function num(text)
  if not LIBRARY then return tonumber(text) end
  local v = numbers[text]
  if v == nil then
    v = tonumber(text) or false
    if numbers_n >= 256 then numbers, numbers_n = {}, 0 end
    numbers[text], numbers_n = v, numbers_n + 1
  end
  return v or nil
end

local function report_config()
  local c = redis.call('HMGET', K_CONFIG, 'dead_after_ms', 'tick_ms')
  local da, tick = c[1], c[2]
  if da ~= seen_da then seen_da, seen_da_n = da, tonumber(da) or 5000 end
  if tick ~= seen_tick then seen_tick, seen_tick_n = tick, tonumber(tick) or 20 end
  return seen_da_n, seen_tick_n
end

-- The helpers of the cold paths (a new generation, a publish, a reap, leave and
-- expiry), defined by cold() on first use. A function library runs this file
-- once, so there it costs one check per call. An EVAL script runs it on every
-- call, where making a closure costs about a thousand instructions (each upvalue
-- is looked up in the list of open ones), and a report needs these only when it
-- publishes, reaps or starts a generation: deferring them saves about 8k
-- instructions of an EVALSHA report (docs/BENCHMARKS.md). Every operation but the
-- report and the lease calls cold() first; the report calls it before each of
-- those paths.
local new_generation, in_grace, ensure_epoch, published_score, head, cut, prune
local remove_engine, publish, maybe_publish, publish_after_change, reap

local function cold()
  if reap then return end -- reap is defined last
  -- The epoch names one generation of state. When it is missing, the state is new
  -- or was lost (restart without persistence, flush): start a clean generation.
  -- A caller that had reported (or coordinated) before sends a candidate starting
  -- with "r-": the state was lost, the engines that knew it are re-registering one
  -- by one, so the first snapshot of this generation waits join_grace_ms for them.
  -- A fresh deployment has nothing to recover and waits only for its registrations.
  function new_generation(candidate, now)
    if not name_arg(candidate) then return nil end
    redis.call('DEL', K_MEMBERS, K_REPORTS, K_META, K_SNAPSHOT)
    redis.call('SET', K_EPOCH, candidate)
    redis.call('HSET', K_REPORTS, F_EPOCH, candidate, F_PUB, '-1', F_BEHIND, '0')
    redis.call('HSET', K_META, 'epoch_start', fmt(now), 'version', '0',
      'grace', string.sub(candidate, 1, 2) == 'r-' and '1' or '0')
    return candidate
  end

  -- whether the first snapshot of a recovered generation must still wait
  function in_grace(meta_grace, epoch_start, now, cfg)
    return meta_grace == '1' and now - (tonumber(epoch_start) or 0) < cfg.join_grace_ms
  end

  function ensure_epoch(candidate, now)
    local epoch = redis.call('HGET', K_REPORTS, F_EPOCH)
    if epoch then return epoch end
    return new_generation(candidate, now)
  end

  function published_score()
    return tonumber(redis.call('HGET', K_REPORTS, F_PUB) or '-1')
  end

  -- A record's head: flag, heartbeat due ms, latest score (nil if no report yet),
  -- latest report ms (0), and the position of its first report line (nil).
  function head(rec)
    local nl = find(rec, '\n', 2, true)
    if not nl then
      return string.sub(rec, 1, 1), tonumber(string.sub(rec, 2)) or 0, nil, 0, nil
    end
    local t1 = find(rec, '\t', nl + 1, true)
    local t2 = find(rec, '\t', t1 + 1, true)
    return string.sub(rec, 1, 1), tonumber(string.sub(rec, 2, nl - 1)) or 0,
      tonumber(string.sub(rec, nl + 1, t1 - 1)), tonumber(string.sub(rec, t1 + 1, t2 - 1)), nl + 1
  end

  -- the json of the newest report at or before score s in rec, or nil; pos is the
  -- position of the first report line and last its score (already parsed by head)
  function cut(rec, s, pos, last)
    local n = #rec
    while pos and pos <= n do
      local t1 = find(rec, '\t', pos, true)
      if last <= s then
        local t2 = find(rec, '\t', t1 + 1, true)
        local nl = find(rec, '\n', t2, true)
        return string.sub(rec, t2 + 1, (nl or n + 1) - 1)
      end
      local nl = find(rec, '\n', t1, true)
      pos = nl and nl + 1
      if pos then
        local t = find(rec, '\t', pos, true)
        last = tonumber(string.sub(rec, pos, t - 1))
      end
    end
    return nil
  end

  -- report lines (newest first): keep those newer than pub, the newest at or
  -- before pub, at most MAX_HISTORY
  function prune(lines, pub)
    local pos, kept, n = 1, 0, #lines
    while pos <= n do
      kept = kept + 1
      local t1 = find(lines, '\t', pos, true)
      local nl = find(lines, '\n', t1, true)
      if not nl then return lines end
      if kept >= MAX_HISTORY or tonumber(string.sub(lines, pos, t1 - 1)) <= pub then
        return string.sub(lines, 1, nl - 1)
      end
      pos = nl + 1
    end
    return lines
  end

  function remove_engine(engine, why)
    local rec = redis.call('HGET', K_REPORTS, engine)
    local removed = redis.call('ZREM', K_MEMBERS, engine)
    if rec then
      redis.call('HDEL', K_REPORTS, engine)
      local flag, _, last = head(rec)
      if flag == 'b' and (not last or last <= published_score()) then
        redis.call('HINCRBY', K_REPORTS, F_BEHIND, -1)
      end
    end
    redis.call('HDEL', K_META, 'stale:' .. engine)
    if removed == 1 or rec then
      redis.call('HINCRBY', K_META, why, 1)
      local gone = redis.call('HGET', K_META, 'gone')
      local item = '"' .. engine .. '":"' .. why .. '"'
      if gone and gone ~= '' then item = gone .. ',' .. item end
      redis.call('HSET', K_META, 'gone', item)
      return 1
    end
    return 0
  end

  -- Publish a consistent cut: every engine's newest report at or before S.
  -- mode "barrier": S = the lowest latest step of the barrier members (all past
  --   pub); nothing is published when there is no member with a report.
  -- mode "forced": S = the lowest latest step among members past pub; the
  --   members still at or before pub are the laggards, named with their age.
  -- mode a number: S is that score (republish after a change, idle heartbeat).
  -- Returns the version published (0 if none) and the laggard ids.
  function publish(mode, now, deployment, pubcmd)
    local flat = redis.call('HGETALL', K_REPORTS)
    -- Per engine n, in parallel arrays (no table per engine): the position of its
    -- id in flat (its record follows), its newest score (false before its first
    -- report), where the json of that report starts and ends in the record;
    -- provisional engines are the few marked in prov. Positions, not substrings:
    -- every Lua string is hashed over all its bytes when made, so a json is cut out
    -- once, for the snapshot, and only if the snapshot takes that line.
    local idx, lasts, ats, ends, prov, hot = {}, {}, {}, {}, {}, {}
    local n = 0
    local fixed = type(mode) == 'number'
    local s = fixed and mode or nil
    for i = 1, #flat, 2 do
      local id, rec = flat[i], flat[i + 1]
      if HOT[id] then
        hot[id] = rec
      else
        n = n + 1
        idx[n] = i
        -- head line, then "<score>\t<report ms>\t<json>" (in lockstep the score
        -- texts repeat), in one anchored match
        local _, e, flag, last = find(rec, '^(.)%d*\n(%d+)\t%d+\t')
        if e then
          if flag ~= 'b' then prov[n] = true end
          lasts[n], ats[n] = numbers[last] or num(last), e + 1
          ends[n] = (find(rec, '\n', e, true) or 0) - 1
        else -- registered, no report yet
          if byte(rec) ~= 98 then prov[n] = true end -- not "b"
          lasts[n] = false
        end
      end
    end
    local pub = tonumber(hot[F_PUB] or '-1') or -1
    if not fixed then
      for i = 1, n do
        local last = lasts[i]
        if last and not prov[i] and (mode == 'barrier' or last > pub) and (not s or last < s) then
          s = last
        end
      end
    end
    if not s or (mode == 'forced' and s <= pub) then return 0, {} end
    -- parts[1] is the head, filled in below: the snapshot is one concatenation (a
    -- snapshot is long, and each intermediate string would be hashed); an engine
    -- adds its key text (',"<id>":', kept in id_keys by a function library) and its json
    local parts, np, joining, laggards, lagnames = {''}, 1, {}, {}, {}
    local behind, ahead = 0, false
    local forced = mode == 'forced'
    for i = 1, n do
      local last, at = lasts[i], idx[i]
      local id, rec = flat[at], flat[at + 1]
      local frag
      if last and last <= s then
        frag = string.sub(rec, ats[i], ends[i])
      elseif last then -- newer than the cut: its newest line at or before s
        frag = cut(rec, s, find(rec, '\n', 2, true) + 1, last)
      end
      if frag then
        local key = id_keys and id_keys[id]
        if not key then
          key = ',"' .. id .. '":'
          if id_keys then remember(id_keys, id, key) end
        end
        parts[np + 1], parts[np + 2] = np == 1 and string.sub(key, 2) or key, frag
        np = np + 2
      else
        joining[#joining + 1] = '"' .. id .. '"'
      end
      if not prov[i] then
        if not last or last <= s then behind = behind + 1 else ahead = true end
        if forced and last and last <= pub then
          laggards[#laggards + 1] = '"' .. id .. '":' .. fmt(now - select(4, head(rec)))
          lagnames[#lagnames + 1] = id
        end
      end
    end
    local version = redis.call('HINCRBY', K_META, 'version', 1)
    local wave = math.floor(s / STEP_SPAN)
    local gone = redis.call('HGET', K_META, 'gone') or ''
    local epoch = hot[F_EPOCH] or ''
    parts[1] = '{"deployment":"' .. deployment .. '","epoch":"' .. epoch ..
      '","version":' .. version .. ',"wave":' .. fmt(wave) .. ',"step":' .. fmt(s - wave * STEP_SPAN) ..
      ',"forced":' .. (forced and 'true' or 'false') .. ',"laggards":{' ..
      table.concat(laggards, ',') .. '},"gone":{' .. gone .. '},"joining":[' ..
      table.concat(joining, ',') .. '],"time_ms":' .. fmt(now) .. ',"engines":{'
    parts[np + 1] = '}}'
    local json = table.concat(parts)
    redis.call('SET', K_SNAPSHOT, json)
    -- SPUBLISH exists from Redis 7.0, which also added redis.REDIS_VERSION_NUM: a 6.2
    -- cluster gets PUBLISH (the router subscribes the same way, see router.py)
    if pubcmd == 'SPUBLISH' and not redis.REDIS_VERSION_NUM then pubcmd = 'PUBLISH' end
    redis.call(pubcmd, K_CHANNEL, json)
    redis.call('HINCRBY', K_META, forced and 'forced' or 'published', 1)
    redis.call('HSET', K_META, 'pub_ms', fmt(now), 'gone', '')
    -- a new barrier is already under way if some member is past s
    if ahead then
      redis.call('HSET', K_REPORTS, F_PUB, fmt(s), F_BEHIND, behind, F_SINCE, fmt(now))
    else
      redis.call('HSET', K_REPORTS, F_PUB, fmt(s), F_BEHIND, behind)
      redis.call('HDEL', K_REPORTS, F_SINCE)
    end
    return version, lagnames
  end

  -- Publish when every barrier member has reached a step past pub (invariant 2).
  -- The first snapshot of a recovered epoch also waits join_grace_ms from the epoch
  -- start, so engines re-registering after a state loss are all in it (invariant 5).
  function maybe_publish(cfg, now, deployment, pubcmd)
    local h = redis.call('HMGET', K_REPORTS, F_PUB, F_BEHIND)
    if (tonumber(h[2]) or 0) > 0 then return 0 end
    if (tonumber(h[1]) or -1) < 0 then
      local m = redis.call('HMGET', K_META, 'epoch_start', 'grace')
      if in_grace(m[2], m[1], now, cfg) then return 0 end
    end
    return (publish('barrier', now, deployment, pubcmd))
  end

  -- After a membership change: publish if the barrier completes, else republish
  -- the current step so that routers learn of the change within one snapshot.
  function publish_after_change(cfg, now, deployment, pubcmd)
    local v = maybe_publish(cfg, now, deployment, pubcmd)
    if v == 0 then
      local pub = published_score()
      if pub >= 0 then v = publish(pub, now, deployment, pubcmd) end
    end
    return v
  end

  -- Expire engines whose last report is older than dead_after_ms. The members
  -- score is refreshed lazily, so a candidate whose record shows a recent report
  -- gets its heartbeat corrected instead.
  function reap(cfg, now, limit)
    -- Nothing reached this deployment for longer than dead_after_ms (Redis down,
    -- paused, or failed over; a coordinator and every engine reap at least every
    -- dead_after_ms / 4 otherwise): the engines could not report, so silence says
    -- nothing about them. Give them dead_after_ms from now before judging.
    local m = redis.call('HMGET', K_META, 'reaped_at', 'hold_until')
    redis.call('HSET', K_META, 'reaped_at', fmt(now))
    local last = tonumber(m[1])
    if last and now - last > cfg.dead_after_ms then
      redis.call('HSET', K_META, 'hold_until', fmt(now + cfg.dead_after_ms))
      return {}
    end
    if m[2] and now < (tonumber(m[2]) or 0) then return {} end
    local cands = redis.call('ZRANGEBYSCORE', K_MEMBERS, '-inf',
      '(' .. fmt(now - cfg.dead_after_ms), 'LIMIT', 0, limit)
    local dead = {}
    for _, engine in ipairs(cands) do
      local rec = redis.call('HGET', K_REPORTS, engine)
      local t = rec and select(4, head(rec)) or 0
      if now - t < cfg.dead_after_ms then
        redis.call('ZADD', K_MEMBERS, fmt(t), engine)
      else
        remove_engine(engine, 'expired')
        dead[#dead + 1] = engine
      end
    end
    return dead
  end
end

local KEY_SUFFIXES = {'config', 'epoch', 'members', 'reports', 'meta', 'snapshot', 'snapshots'}
local NUM_KEYS = #KEY_SUFFIXES -- 7: common_args compares them unrolled

-- deployment -> its seven expected key names, kept by a function library (which
-- sets LIBRARY = true: lua/library.lua) between calls: Lua interns strings, so
-- comparing KEYS with them is a pointer comparison. An EVAL script runs this file
-- on every call and gains nothing from a cache. Bounded: reset past 64 deployments.
local key_names, key_names_n = {}, 0

local function keys_match(deployment)
  local want = key_names[deployment]
  if want then
    for i = 1, NUM_KEYS do
      if KEYS_IN[i] ~= want[i] then return i, want[i] end
    end
    return nil
  end
  local prefix = 'redisbal:{' .. deployment .. '}:'
  for i = 1, NUM_KEYS do
    local k = prefix .. KEY_SUFFIXES[i]
    if KEYS_IN[i] ~= k then return i, k end
  end
  if LIBRARY then
    if key_names_n >= 64 then key_names, key_names_n = {}, 0 end
    key_names[deployment], key_names_n = {unpack(KEYS_IN, 1, NUM_KEYS)}, key_names_n + 1
  end
  return nil
end

-- Checks every script makes before touching anything: the ARGV count (nmin..nmax),
-- the deployment name, and that KEYS are exactly this deployment's seven keys, so
-- a direct caller with missing, extra or foreign keys gets an error, not a raw Lua
-- error half-way through (after writes) or writes under another deployment's keys.
local function common_args(deployment, pubcmd, nmin, nmax)
  -- the usual call, in a function library: a deployment seen before, its seven keys
  -- compared unrolled (pointer comparisons: a loop and a call cost several times more)
  local want, k, nargv = key_names[deployment], KEYS_IN, #ARGV_IN
  if want and nargv >= nmin and (not nmax or nargv <= nmax) and #k == 7 and k[1] == want[1]
    and k[2] == want[2] and k[3] == want[3] and k[4] == want[4] and k[5] == want[5]
    and k[6] == want[6] and k[7] == want[7] and (pubcmd == 'PUBLISH' or pubcmd == 'SPUBLISH') then
    return nil
  end
  if nargv < nmin or (nmax and nargv > nmax) then
    return 'expected ' .. nmin .. (nmax == nmin and '' or (nmax and '..' .. nmax or ' or more')) ..
      ' arguments, got ' .. nargv
  end
  if not key_names[deployment] and not name_arg(deployment) then
    return 'bad deployment name'
  end
  if #KEYS_IN ~= NUM_KEYS then
    return 'expected ' .. NUM_KEYS .. ' keys, got ' .. #KEYS_IN
  end
  local bad, want = keys_match(deployment)
  if bad then return 'bad key ' .. bad .. ': expected ' .. want end
  if pubcmd ~= 'PUBLISH' and pubcmd ~= 'SPUBLISH' then
    return 'bad publish command (PUBLISH or SPUBLISH)'
  end
  return nil
end

-- nil when token is "" (unfenced call) or matches the config's fence
local function fenced(token)
  if token == nil or token == '' then return nil end
  local fence = redis.call('HGET', K_CONFIG, 'fence') or '0'
  if fence ~= token then
    return fail('fenced: this coordinator\'s lease (fence ' .. token .. ') was taken over (fence ' ..
      fence .. ')')
  end
  return nil
end
