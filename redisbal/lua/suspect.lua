--[[
  suspect: an API server could not reach an engine (router.failed): mark it
  suspect, so that every router stops choosing it at the next snapshot, which
  this call publishes. The mark holds suspect_ms, or until the engine's next
  progress (report.lua). It never takes the last engines away: at most half
  of the deployment's engines (rounded down) are suspect at once.

  KEYS: the deployment's seven keys (includes/deployment.lua)
  ARGV[1] deployment name
  ARGV[2] "PUBLISH" or "SPUBLISH"
  ARGV[3] engine id
  ARGV[4] the caller's client index (0..4095), or "-" (not a router: a sidecar
          whose scrape of the engine failed)
  ARGV[5] reason: what the caller saw, up to 200 characters, no control
          characters (stored for `redisbal status`, never in a snapshot)
  Returns {status, version}: status "suspect" (marked until suspect_ms from
  now; version of the snapshot that says so), "capped" (half the engines are
  suspect already: nothing written) or "unknown" (not a member that reported);
  version 0 when nothing was published.
  Errors: "redisbal: bad <field>: ..." before anything is written.
]]
--- @include "args"
--- @include "deployment"
--- @include "time"
--- @include "record"
--- @include "barrier"

local d, err = open_deployment(KEYS, ARGV, 5, 5)
if not d then return fail(err) end
local engine = name_arg(ARGV[3])
if not engine then return fail('bad engine_id: ' .. ARGV[3]) end
local client_text = ARGV[4]
if client_text ~= '-' and not int_arg(client_text, 0, 4095) then
  return fail('bad client index: ' .. client_text)
end
local reason = ARGV[5]
if #reason > 200 or string.find(reason, '%c') then
  return fail('bad reason: at most 200 characters, no control characters')
end
if not redis.call('HGET', d.reports, '.epoch') then return {'unknown', 0} end
local text = redis.call('HGET', d.reports, engine)
local rec = text and parse_record(text)
if not rec or not rec.score then return {'unknown', 0} end

local now, now_text = now_ms()
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

local until_text = int_text(now + config_value(d, 'suspect_ms'))
local head = format_head(rec.flag, rec.due, rec.inc, rec.offset, rec.progress, until_text)
local older = rec.older_at and string.sub(text, rec.older_at) or ''
redis.call('HSET', d.reports, engine, format_record(head, rec.line, older))
redis.call('HSET', d.meta, 'suspect:' .. engine, now_text .. ' ' .. client_text .. ' ' .. reason)
redis.call('HINCRBY', d.meta, 'suspected', 1)
return {'suspect', publish_after_change(d, now)}
