--[[
  report_8.lua: record one engine's step-tagged counts; publish the snapshot
  when this report completes the barrier.

  KEYS: the eight keys of common.lua (config, epoch, members, barrier,
        reports, meta, snapshot, channel).
  ARGV[1]  deployment name (goes into the snapshot JSON)
  ARGV[2]  "PUBLISH" or "SPUBLISH"
  ARGV[3]  epoch candidate: becomes the epoch if state was lost / is new
  ARGV[4]  engine id
  ARGV[5]  wave (0..2^20-1); ignored in tick mode
  ARGV[6]  step (0..2^32-1), or "tick": tag with the server's current tick
           floor(server_ms / tick_ms), shared by all independent engines
  ARGV[7]  waiting (0..1e9)
  ARGV[8]  running (0..1e9)
  ARGV[9]  kv_usage in [0, 1], or "" when unknown
  ARGV[10] admitted: comma-separated cumulative request counts received per
           API-server index ("" when not reported)

  Returns: {status, version, wave, step}
    status  "accepted" or "stale" (older than this engine's latest: counted,
            nothing changed)
    version version of the snapshot this call published, 0 if none
    wave, step  the tag the report was recorded under (as strings)
  Errors: "ERR redisbal: bad <field>: ..." before anything is written.
]]

local deployment, pubcmd = ARGV[1], ARGV[2]
local err = common_args(deployment, pubcmd)
if err then return fail(err) end
local engine = name_arg(ARGV[4])
if not engine then return fail('bad engine_id: ' .. tostring(ARGV[4])) end
local waiting = int_arg(ARGV[7], 0, MAX_COUNT)
if not waiting then return fail('bad waiting: ' .. tostring(ARGV[7])) end
local running = int_arg(ARGV[8], 0, MAX_COUNT)
if not running then return fail('bad running: ' .. tostring(ARGV[8])) end
local kv = 'null'
if ARGV[9] ~= '' then
  local v = string.match(ARGV[9], '^%d*%.?%d+$') and tonumber(ARGV[9])
  if not v or v < 0 or v > 1 then return fail('bad kv_usage: ' .. tostring(ARGV[9])) end
  kv = ARGV[9]
end
local adm = ARGV[10]
if adm ~= '' then
  if #adm > 65536 or string.find(adm, '[^%d,]') or string.find(adm, ',,')
    or string.find(adm, '^,') or string.find(adm, ',$')
    or string.find(adm, '%d%d%d%d%d%d%d%d%d%d%d%d%d%d%d%d') then
    return fail('bad admitted: expected comma-separated counts')
  end
end

local now = now_ms()
local cfg = config()
local score
if ARGV[6] == 'tick' then
  score = math.floor(now / cfg.tick_ms)
else
  local wave = int_arg(ARGV[5], 0, MAX_WAVE)
  if not wave then return fail('bad wave: ' .. tostring(ARGV[5])) end
  local step = int_arg(ARGV[6], 0, STEP_SPAN - 1)
  if not step then return fail('bad step: ' .. tostring(ARGV[6])) end
  score = wave * STEP_SPAN + step
end
local wave = math.floor(score / STEP_SPAN)
local step = score - wave * STEP_SPAN

if not ensure_epoch(ARGV[3], now) then return fail('bad epoch candidate') end
local pub = published_score()
local rec = redis.call('HGET', K.reports, engine)
local last = rec and latest_score(rec)

-- invariant 3: older than this engine's latest accepted report
if last and score < last then
  redis.call('HINCRBY', K.meta, 'stale', 1)
  redis.call('HINCRBY', K.meta, 'stale:' .. engine, 1)
  return {'stale', 0, fmt(wave), fmt(step)}
end

local frag = '{"wave":' .. fmt(wave) .. ',"step":' .. fmt(step) .. ',"waiting":' .. fmt(waiting) ..
  ',"running":' .. fmt(running) .. ',"kv":' .. kv .. ',"t":' .. fmt(now)
if adm ~= '' then frag = frag .. ',"adm":[' .. adm .. ']' end
local line = fmt(score) .. '\t' .. frag .. '}'

if not rec then
  rec = line
  redis.call('HINCRBY', K.meta, 'joined', 1)
elseif score == last then
  -- same-step refresh (before/after step, or a retry): replace the newest entry
  local nl = string.find(rec, '\n', 1, true)
  rec = nl and (line .. string.sub(rec, nl)) or line
else
  if score <= pub then redis.call('HINCRBY', K.meta, 'late', 1) end
  rec = prune(line .. '\n' .. rec, pub)
end
redis.call('HSET', K.reports, engine, rec)
redis.call('ZADD', K.members, fmt(now), engine)
redis.call('HINCRBY', K.meta, 'reports', 1)

-- barrier membership: everyone before the first snapshot; later, a joiner
-- behind the published step stays provisional (in snapshots, not holding the
-- barrier) until it reaches a step past it (invariant 5)
if pub < 0 or score > pub or redis.call('ZSCORE', K.barrier, engine) then
  redis.call('ZADD', K.barrier, fmt(score), engine)
end
if score > pub then redis.call('HSETNX', K.meta, 'since', fmt(now)) end

local version
if #reap(cfg, now, 8) > 0 then
  version = publish_after_change(cfg, now, deployment, pubcmd)
else
  version = maybe_publish(cfg, now, deployment, pubcmd)
end
return {'accepted', version, fmt(wave), fmt(step)}
