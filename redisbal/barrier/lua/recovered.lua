--[[
  recovered: an API server sent a probe to an engine whose ejection ended
  (the snapshot's "probing") and it answered: clear the mark, so that every
  router routes to it normally again at the next snapshot, which this call
  publishes. Only an answer clears a mark (suspect.lua): the back-off level
  stays in meta suspect:<engine>, so that a relapse soon after backs off longer.

  KEYS: the deployment's seven keys (includes/deployment.lua)
  ARGV[1] deployment name
  ARGV[2] "PUBLISH" or "SPUBLISH"
  ARGV[3] engine id
  ARGV[4] the caller's client index (0..4095), or "-" (not a router)
  Returns {status, version}: status "recovered" (the mark is cleared; version
  of the snapshot that says so), "ejected" (its back-off has not ended: a
  newer failure than this answer; nothing written), "healthy" (no mark) or
  "unknown" (not a member that reported); version 0 when nothing was published.
  Errors: "redisbal: bad <field>: ..." before anything is written.
]]
--- @include "args"
--- @include "deployment"
--- @include "time"
--- @include "record"
--- @include "barrier"
--- @include "marks"

local d, err = open_deployment(KEYS, ARGV, 4, 4)
if not d then return fail(err) end
local engine, client_text, why = mark_args(ARGV)
if not engine then return fail(why) end
local text, rec = reported_record(d, engine)
if not text then return {'unknown', 0} end
if rec.suspect == 0 then return {'healthy', 0} end
local now = now_ms()
if rec.suspect > now then return {'ejected', 0} end

local head = format_head(rec.flag, rec.due, rec.inc, rec.offset, rec.progress, '0')
local older = rec.older_at and string.sub(text, rec.older_at) or ''
redis.call('HSET', d.reports, engine, format_record(head, rec.line, older))
redis.call('HINCRBY', d.meta, 'recovered', 1)
return {'recovered', publish_after_change(d, now)}
