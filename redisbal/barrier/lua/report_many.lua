--[[
  report_many: record the reports of several engines of one deployment in one
  call (a process that reports for several engines: a front-end with several
  data-parallel engines, a sidecar scraping a page of several engines), then
  publish at most once, after every report is in.

  Each report does exactly what a report.lua call with the same arguments
  does (includes/reports.lua), in the order given; the barrier check and any
  publish (or republish after a membership change), and an expiry of dead
  engines on the way, come once, at the end. A sequence of reports sent in
  batches leaves the state that sending them one by one leaves when the barrier
  completes only at the end of each batch; otherwise it skips the snapshots
  the intermediate reports would have published.

  KEYS: the deployment's seven keys (includes/deployment.lua)
  ARGV[1]  deployment name
  ARGV[2]  "PUBLISH" or "SPUBLISH" (a cluster deployment)
  ARGV[3]  epoch candidate (as report.lua)
  ARGV[4]  n: how many reports follow (1..MAX_REPORTS)
  then n groups of nine or ten (every group the same), report i at
  ARGV[5 + k * (i - 1)] ...:
    engine id, wave, step (or "tick"), waiting, running, kv_usage (or ""),
    admitted (or ""), incarnation (or "-"), progress ("1" or "0"), and in a
    group of ten admitted_total (or "")
  (report.lua's ARGV[4..13], with the incarnation and progress required).
  Each engine id at most once per call.

  Returns one reply per report, in order, each as report.lua's:
    {status, version, wave, step[, incarnation]}
  version: of the snapshot this call published (for every accepted report;
  0 for a stale or conflict one, and when the call published none).
  Errors: "redisbal: report i of n (engine <id>): bad <field>: ..." (or "bad
  report count", "bad arguments") before anything is written: a call with one
  bad report stores nothing, for any engine.
]]
--- @include "args"
--- @include "deployment"
--- @include "time"
--- @include "reports"

local MAX_REPORTS = 1024
local FIELDS_PER_REPORT = 10 -- or 9: without admitted_total

local d, err = open_deployment(KEYS, ARGV, 13)
if not d then return fail(err) end
local n = tonumber(string.match(ARGV[4], '^[1-9]%d?%d?%d?$'))
if not n or n > MAX_REPORTS then
  return fail('bad report count: ' .. ARGV[4] .. ' (1..' .. MAX_REPORTS .. ')')
end
local k = FIELDS_PER_REPORT
if #ARGV == 4 + (k - 1) * n then k = k - 1 end
if #ARGV ~= 4 + k * n then
  return fail('bad arguments: expected ' .. (4 + (k - 1) * n) .. ' or ' .. (4 + k * n) ..
    ' for ' .. n .. ' reports, got ' .. #ARGV)
end

-- where report i of n is, for a refusal (made only then)
local function where(i, engine)
  return 'report ' .. i .. ' of ' .. n .. (engine and ' (engine ' .. engine .. ')' or '')
end

local reports, engines, seen = {}, {}, {}
for i = 1, n do
  local a = 4 + k * (i - 1)
  local engine = ARGV[a + 1]
  if not name_arg(engine) then return fail(where(i) .. ': bad engine_id: ' .. engine) end
  if seen[engine] then return fail(where(i, engine) .. ': bad engine_id: given twice') end
  seen[engine] = true
  local e, bad = check_report(engine, ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], ARGV[a + 5],
    ARGV[a + 6], ARGV[a + 7], ARGV[a + 8], ARGV[a + 9], k == 10 and ARGV[a + 10] or '')
  if not e then return fail(where(i, engine) .. ': ' .. bad) end
  reports[i], engines[i] = e, engine
end

local now, now_text = now_ms()
local pass
pass, err = begin_reports(d, engines, ARGV[3], now, now_text)
if not pass then return fail(err) end
local replies = {}
for i = 1, n do
  local reply, bad = apply_report(pass, i, reports[i])
  -- (only a score past 2^53; the pass has written nothing yet)
  if not reply then
    return fail(where(i, engines[i]) .. ': ' .. bad)
  end
  replies[i] = reply
end
local version = end_reports(pass)
if version ~= 0 then
  for i = 1, n do
    if replies[i][1] == 'accepted' then replies[i][2] = version end
  end
end
return replies
