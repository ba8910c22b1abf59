--[[
  common.lua: shared by every redisbal script (redisbal/scripts.py prepends it).

  Every script gets the same eight KEYS, all of one deployment and so of one
  hash slot (they share the hash tag "{<deployment>}"):
    KEYS[1] config    HASH  settings (dead_after_ms, stall_ms, tick_ms, ...)
    KEYS[2] epoch     STRING id of this state generation
    KEYS[3] members   ZSET  engine -> server ms of its last report (liveness)
    KEYS[4] barrier   ZSET  engine -> (wave, step) score of its latest report;
                            barrier members only (provisional joiners are not)
    KEYS[5] reports   HASH  engine -> recent accepted reports, newest first
    KEYS[6] meta      HASH  pub (published score), version, since, counters
    KEYS[7] snapshot  STRING latest snapshot JSON
    KEYS[8] channel   the pub/sub channel; passed in KEYS, not built here, so
                      that Redis Cluster sees its slot (it is the same slot)

  A (wave, step) pair is one number: wave * 2^32 + step (< 2^52, exact in a
  double and in a ZSET score). "pub" is the score of the last published
  snapshot, -1 before the first one of an epoch.

  A reports entry is "<score>\t<json>" lines, newest first; <json> is the
  engine's snapshot fragment. We keep every entry newer than pub plus the
  newest one at or before pub: exactly what any future cut can need.
]]

local STEP_SPAN = 4294967296
local MAX_WAVE = 1048575
local MAX_COUNT = 1000000000
local MAX_HISTORY = 256
local NAME_PATTERN = '^[A-Za-z0-9][A-Za-z0-9_.%-]*$'

local K = {
  config = KEYS[1], epoch = KEYS[2], members = KEYS[3], barrier = KEYS[4],
  reports = KEYS[5], meta = KEYS[6], snapshot = KEYS[7], channel = KEYS[8],
}

local function fail(msg)
  return redis.error_reply('ERR redisbal: ' .. msg)
end

local function fmt(n)
  return string.format('%.0f', n)
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- nil when s is not a whole number in [lo, hi]
local function int_arg(s, lo, hi)
  if type(s) ~= 'string' or not string.match(s, '^%-?%d+$') or #s > 16 then return nil end
  local n = tonumber(s)
  if n == nil or n < lo or n > hi then return nil end
  return n
end

local function name_arg(s)
  if type(s) ~= 'string' or #s < 1 or #s > 64 or not string.match(s, NAME_PATTERN) then
    return nil
  end
  return s
end

local function config()
  local c = redis.call('HMGET', K.config, 'dead_after_ms', 'stall_ms', 'tick_ms',
    'join_grace_ms', 'idle_publish_ms')
  return {
    dead_after_ms = tonumber(c[1]) or 5000,
    stall_ms = tonumber(c[2]) or 250,
    tick_ms = tonumber(c[3]) or 20,
    join_grace_ms = tonumber(c[4]) or 1000,
    idle_publish_ms = tonumber(c[5]) or 1000,
  }
end

-- The epoch names one generation of state. When it is missing, state was lost
-- (restart without persistence, flush): start a clean generation.
local function ensure_epoch(candidate, now)
  local epoch = redis.call('GET', K.epoch)
  if epoch then return epoch end
  if not name_arg(candidate) then return nil end
  redis.call('DEL', K.members, K.barrier, K.reports, K.meta, K.snapshot)
  redis.call('SET', K.epoch, candidate)
  redis.call('HSET', K.meta, 'pub', '-1', 'epoch_start', fmt(now), 'version', '0')
  return candidate
end

local function published_score()
  return tonumber(redis.call('HGET', K.meta, 'pub') or '-1')
end

local function entry_score(line)
  local tab = string.find(line, '\t', 1, true)
  return tonumber(string.sub(line, 1, tab - 1)), tab
end

-- the newest entry at or before score s: (json, score) or nil
local function cut(rec, s)
  for line in string.gmatch(rec, '[^\n]+') do
    local sc, tab = entry_score(line)
    if sc <= s then return string.sub(line, tab + 1), sc end
  end
  return nil
end

local function latest_score(rec)
  local nl = string.find(rec, '\n', 1, true)
  local first = nl and string.sub(rec, 1, nl - 1) or rec
  return (entry_score(first))
end

-- keep entries newer than pub, the newest at or before pub, at most MAX_HISTORY
local function prune(rec, pub)
  local kept = {}
  for line in string.gmatch(rec, '[^\n]+') do
    if #kept >= MAX_HISTORY then break end
    kept[#kept + 1] = line
    if entry_score(line) <= pub then break end
  end
  return table.concat(kept, '\n')
end

local function remove_engine(engine, why)
  local removed = redis.call('ZREM', K.members, engine)
  redis.call('ZREM', K.barrier, engine)
  redis.call('HDEL', K.reports, engine)
  redis.call('HDEL', K.meta, 'stale:' .. engine)
  if removed == 1 then
    redis.call('HINCRBY', K.meta, why, 1)
    local gone = redis.call('HGET', K.meta, 'gone')
    local item = '"' .. engine .. '":"' .. why .. '"'
    if gone and gone ~= '' then item = gone .. ',' .. item end
    redis.call('HSET', K.meta, 'gone', item)
  end
  return removed
end

-- Publish the consistent cut at score s: every engine's newest report <= s.
-- laggards: JSON object text of engine -> age ms ('' when not forced).
local function publish(s, forced, laggards, now, deployment, pubcmd)
  local version = redis.call('HINCRBY', K.meta, 'version', 1)
  local flat = redis.call('HGETALL', K.reports)
  local parts, waiting_for = {}, {}
  for i = 1, #flat, 2 do
    local frag = cut(flat[i + 1], s)
    if frag then
      parts[#parts + 1] = '"' .. flat[i] .. '":' .. frag
    else
      waiting_for[#waiting_for + 1] = '"' .. flat[i] .. '"'
    end
  end
  local wave = math.floor(s / STEP_SPAN)
  local gone = redis.call('HGET', K.meta, 'gone') or ''
  local json = '{"deployment":"' .. deployment .. '","epoch":"' .. redis.call('GET', K.epoch) ..
    '","version":' .. version .. ',"wave":' .. fmt(wave) .. ',"step":' .. fmt(s - wave * STEP_SPAN) ..
    ',"forced":' .. (forced and 'true' or 'false') .. ',"laggards":{' .. laggards ..
    '},"gone":{' .. gone .. '},"joining":[' .. table.concat(waiting_for, ',') ..
    '],"time_ms":' .. fmt(now) .. ',"engines":{' .. table.concat(parts, ',') .. '}}'
  redis.call('SET', K.snapshot, json)
  redis.call(pubcmd, K.channel, json)
  redis.call('HINCRBY', K.meta, forced and 'forced' or 'published', 1)
  redis.call('HSET', K.meta, 'pub', fmt(s), 'pub_ms', fmt(now), 'gone', '')
  -- a new barrier is already under way if some engine is past s
  if #redis.call('ZRANGEBYSCORE', K.barrier, '(' .. fmt(s), '+inf', 'LIMIT', 0, 1) > 0 then
    redis.call('HSET', K.meta, 'since', fmt(now))
  else
    redis.call('HDEL', K.meta, 'since')
  end
  return version
end

-- Publish when every barrier member has reached a step past pub (invariant 2).
-- The first snapshot of an epoch also waits join_grace_ms from the epoch start,
-- so engines re-registering after a state loss are all in it (invariant 5).
local function maybe_publish(cfg, now, deployment, pubcmd)
  local pub = published_score()
  local low = redis.call('ZRANGE', K.barrier, 0, 0, 'WITHSCORES')
  if #low == 0 then return 0 end
  local s = tonumber(low[2])
  if s <= pub then return 0 end
  if pub < 0 then
    local start = tonumber(redis.call('HGET', K.meta, 'epoch_start') or '0')
    if now - start < cfg.join_grace_ms then return 0 end
  end
  return publish(s, false, '', now, deployment, pubcmd)
end

-- After a membership change: publish if the barrier completes, else republish
-- the current step so that routers learn of the change within one snapshot.
local function publish_after_change(cfg, now, deployment, pubcmd)
  local v = maybe_publish(cfg, now, deployment, pubcmd)
  if v == 0 then
    local pub = published_score()
    if pub >= 0 then v = publish(pub, false, '', now, deployment, pubcmd) end
  end
  return v
end

-- Expire engines whose last report is older than dead_after_ms.
local function reap(cfg, now, limit)
  local dead = redis.call('ZRANGEBYSCORE', K.members, '-inf', '(' .. fmt(now - cfg.dead_after_ms),
    'LIMIT', 0, limit)
  for _, engine in ipairs(dead) do remove_engine(engine, 'expired') end
  return dead
end

local function common_args(deployment, pubcmd)
  if not name_arg(deployment) then return 'bad deployment name' end
  if pubcmd ~= 'PUBLISH' and pubcmd ~= 'SPUBLISH' then
    return 'bad publish command (PUBLISH or SPUBLISH)'
  end
  return nil
end

-- nil when token is "" (unfenced call) or matches the config's fence
local function fenced(token)
  if token == nil or token == '' then return nil end
  local fence = redis.call('HGET', K.config, 'fence') or '0'
  if fence ~= token then
    return fail('fenced: this coordinator\'s lease (fence ' .. token .. ') was taken over (fence ' ..
      fence .. ')')
  end
  return nil
end
