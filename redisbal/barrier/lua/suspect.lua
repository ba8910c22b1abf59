--[[
  suspect: an API server saw a request to an engine fail (router.failed): eject
  it, so that every router stops choosing it at the next snapshot, which this
  call publishes. The ejection holds a back-off: suspect_ms / 8 (at least 50
  ms), doubled for every ejection that follows the previous one within
  8 x suspect_ms (a failed probe, a relapse), up to suspect_ms. When it ends
  the engine is probing (the snapshot's "probing"): routers send it one request
  at a time, and one that answered clears the mark (recovered.lua). Neither
  time nor the engine's own reports clear it: outcomes over self-reports. It
  never takes the last engines away: at most half of the deployment's engines
  (rounded down) are ejected at once.

  KEYS: the deployment's seven keys (includes/deployment.lua)
  ARGV[1] deployment name
  ARGV[2] "PUBLISH" or "SPUBLISH"
  ARGV[3] engine id
  ARGV[4] the caller's client index (0..4095), or "-" (not a router: a sidecar
          whose scrape of the engine failed)
  ARGV[5] reason: what the caller saw, up to 200 characters, no control
          characters (stored for `redisbal status`, never in a snapshot)
  Returns {status, version}: status "suspect" (ejected for its back-off;
  version of the snapshot that says so), "held" (ejected already: only the
  reason is updated), "capped" (half the engines are ejected already: nothing
  written) or "unknown" (not a member that reported); version 0 when nothing
  was published. meta suspect:<engine> holds "<ms> <client> <level> <reason>"
  (the last mark and its back-off level; kept after recovery for the next
  back-off, removed when the engine leaves or restarts).
  Errors: "redisbal: bad <field>: ..." before anything is written.
]]
--- @include "args"
--- @include "deployment"
--- @include "time"
--- @include "record"
--- @include "barrier"
--- @include "marks"

local d, err = open_deployment(KEYS, ARGV, 5, 5)
if not d then return fail(err) end
local engine, client_text, why = mark_args(ARGV)
if not engine then return fail(why) end
local reason = ARGV[5]
if #reason > 200 or string.find(reason, '%c') then
  return fail('bad reason: at most 200 characters, no control characters')
end
local text, rec = reported_record(d, engine)
if not text then return {'unknown', 0} end

local now, now_text = now_ms()
local mark_field = 'suspect:' .. engine
local mark = redis.call('HGET', d.meta, mark_field)
local last_ms, level = 0, 0
if mark then
  local ms_text, level_text = string.match(mark, '^(%d+) %S+ (%d+) ')
  last_ms, level = tonumber(ms_text) or 0, tonumber(level_text) or 0
end
local longest = config_value(d, 'suspect_ms')
if rec.suspect > now then -- ejected already: a request sent before; the reason only
  redis.call('HSET', d.meta, mark_field, int_text(last_ms) .. ' ' .. client_text .. ' ' ..
    int_text(level) .. ' ' .. reason)
  return {'held', 0}
end
-- the cap: engines that reported, and how many other ones are suspect now
local engines, others = 0, 0
local flat = redis.call('HGETALL', d.reports)
for i = 1, #flat, 2 do
  if is_engine_field(flat[i]) then
    local other = parse_record(flat[i + 1])
    if other.score then
      engines = engines + 1
      if flat[i] ~= engine and other.suspect > now then others = others + 1 end
    end
  end
end
if others + 1 > math.floor(engines / 2) then
  redis.call('HINCRBY', d.meta, 'suspect_capped', 1)
  return {'capped', 0}
end

-- a failed probe (the mark lapsed into probing) or a relapse soon after the last
-- ejection doubles the back-off; else it starts over
if rec.suspect ~= 0 or now - last_ms < 8 * longest then level = math.min(level + 1, 30)
else level = 0 end
local base = math.max(50, math.floor(longest / 8))
local until_text = int_text(now + math.min(longest, base * 2 ^ level))
local head = format_head(rec.flag, rec.due, rec.inc, rec.offset, rec.progress, until_text)
local older = rec.older_at and string.sub(text, rec.older_at) or ''
redis.call('HSET', d.reports, engine, format_record(head, rec.line, older))
redis.call('HSET', d.meta, mark_field, now_text .. ' ' .. client_text .. ' ' .. int_text(level) ..
  ' ' .. reason)
redis.call('HINCRBY', d.meta, 'suspected', 1)
return {'suspect', publish_after_change(d, now)}
