--[[
  report: record one engine's counts for one step, and publish the snapshot
  when this report completes the barrier (or changed what routers must know).

  KEYS: the deployment's seven keys (includes/deployment.lua)
  ARGV[1]  deployment name
  ARGV[2]  "PUBLISH" or "SPUBLISH" (a cluster deployment)
  ARGV[3]  epoch candidate: becomes the epoch if the state is new or was lost
           ("r-..." when the caller had state before: includes/generation.lua)
  ARGV[4]  engine id
  ARGV[5]  wave (0..2^20-1); ignored in tick mode
  ARGV[6]  step (0..2^32-1), or "tick": tag the report with the server's tick
           (includes/score.lua), shared by all engines that have no steps
  ARGV[7]  waiting (0..1e9)
  ARGV[8]  running (0..1e9)
  ARGV[9]  kv_usage in [0, 1], or "" when unknown
  ARGV[10] admitted: comma-separated cumulative counts of requests received
           per API-server index, or "" when not reported
  ARGV[11] optional: incarnation of the reporting process; "-" when not named
           (the default; includes/incarnation.lua)
  ARGV[12] optional: progress: "1" (the default) when the engine's loop made this
           report, "0" for a heartbeat re-sending unchanged counts (progress, not pulse)
  ARGV[13] optional: admitted_total: the engine's cumulative count of requests
           taken in (finished + waiting + running, 0..10^15-1), or "" (the
           default) when not reported

  Returns {status, version, wave, step[, incarnation]}:
    status   "accepted"; "stale": older than this engine's latest report
             (counted, nothing else changed); "conflict": from an incarnation
             older than the engine's record (a replaced process, or two
             processes under one engine id): refused and counted, and the
             record's incarnation is the fifth element
    version  of the snapshot this call published, 0 if none
    wave, step  the tag the report was recorded under (in tick mode, the tick)
  Errors: "redisbal: bad <field>: ..." before anything is written.

  What a report does (stale, conflict, restart, join, stall, heartbeat,
  expiry on the way) is in includes/reports.lua, shared with report_many.lua.
]]
--- @include "deployment"
--- @include "time"
--- @include "reports"

local d, err = open_deployment(KEYS, ARGV, 10, 13)
if not d then return fail(err) end
local e
e, err = check_report(ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10],
  ARGV[11] or '-', ARGV[12] or '1', ARGV[13] or '')
if not e then return fail(err) end
local now, now_text = now_ms()
local pass
pass, err = begin_reports(d, {e.engine}, ARGV[3], now, now_text)
if not pass then return fail(err) end
local reply
reply, err = apply_report(pass, 1, e)
if not reply then return fail(err) end
local version = end_reports(pass)
if reply[1] == 'accepted' then reply[2] = version end
return reply
