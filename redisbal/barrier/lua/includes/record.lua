--[[
  record: an engine's record, the value of its field in the reports hash, read
  and written only here (and, for Python, only by redisbal/barrier/record.py; the
  format is in docs/DESIGN.md).

    <flag><heartbeat due ms> <incarnation> <offset> <progress ms> <suspect until ms>
    <score>\t<report ms>\t<json>        the newest report
    <score>\t<report ms>\t<json>        older ones, newest first

  flag "b": a barrier member; "p": a provisional joiner (it joined behind the
  published step: it is in snapshots but the barrier does not wait for it);
  "s": stalled (work queued or running and no progress for stall_after_ms:
  in snapshots, named as stalled, not waited for). The heartbeat due ms is when
  a report next refreshes the engine's heartbeat in the members zset. The rest
  of the head line may be missing (a registered engine: "-" 0 0 0):
  incarnation  the reporting process ("-": unknown; includes/incarnation.lua)
  offset       added to the engine's own (wave, step) score to place it in the
               deployment's order (a restarted lockstep engine starts a new step
               sequence after the published step)
  progress ms  server ms of the engine's last report that was not a heartbeat
  suspect ms   server ms until which the engine is suspect (router.failed), 0
  A registered engine that has not reported yet has the head line only.
  <score> is the report's tag in the deployment's order (includes/score.lua,
  plus the offset), <report ms> the server time it arrived, <json> what a
  snapshot shows for the engine:
    {"wave":W,"step":S,"waiting":N,"running":N,"kv":X,"t":MS,"adm":[N,...],"tot":N,"inc":"I"}
  (W and S are the engine's own; kv is a number in [0, 1] or null; t is when
  the counts were made, counted_ms; "adm", the admitted counts per API server,
  only when the engine sent them; "tot", its admitted total (finished + waiting +
  running), only when the engine sent one; "inc" only when the report named its
  incarnation).

  Kept: every report newer than the published score and the newest one at or
  before it, which is exactly what any future cut can need (MAX_HISTORY at most).

  In Lua, parse_record gives a read-only view of a record's text:
    {flag = 'b', due = text, inc = text, offset = text, progress = text,
     suspect = number, score = number, line = text, text = text, older_at = n}
  due, offset and progress as text (kept as read: a number's text costs a
  sprintf); score and line: the newest report's score and line (nil before the
  first report); older_at: where the older lines start in text (nil if none).
  An operation takes a record apart only as far as it needs and writes a new
  text with format_head and format_record, or, with a new report,
  format_report.
]]
--- @include "args"

local MAX_HISTORY = 256

-- The score of a report line (the number before its first tab).
local function line_score(line)
  return tonumber(string.sub(line, 1, string.find(line, '\t', 1, true) - 1))
end

-- The server ms a report line arrived.
local function line_ms(line)
  local tab1 = string.find(line, '\t', 1, true)
  local tab2 = string.find(line, '\t', tab1 + 1, true)
  return tonumber(string.sub(line, tab1 + 1, tab2 - 1))
end

-- A report line's JSON, as snapshots show it.
local function line_json(line)
  local tab1 = string.find(line, '\t', 1, true)
  return string.sub(line, string.find(line, '\t', tab1 + 1, true) + 1)
end

-- The head line's fields after flag and due (a short head: the defaults).
local function head_fields(rest)
  local inc, offset, progress, suspect = string.match(rest, '^ (%S+) (%d+) (%d+) (%d+)$')
  if not inc then return '-', '0', '0', 0 end
  return inc, offset, progress, tonumber(suspect)
end

-- The view of a record's text (above).
local function parse_record(text)
  local head_end = string.find(text, '\n', 1, true)
  local flag, due, rest = string.match(head_end and string.sub(text, 1, head_end - 1) or text,
    '^(%a)(%d*)(.*)$')
  local inc, offset, progress, suspect = head_fields(rest)
  local rec = {flag = flag, due = due, inc = inc, offset = offset, progress = progress,
    suspect = suspect, text = text}
  if not head_end then return rec end -- registered, no report yet
  local line_start = head_end + 1
  rec.score = tonumber(string.match(text, '^(%d+)\t', line_start))
  local line_end = string.find(text, '\n', line_start, true)
  rec.line = string.sub(text, line_start, (line_end or #text + 1) - 1)
  rec.older_at = line_end and line_end + 1
  return rec
end

-- What a publish reads of every engine, without taking its record apart: the
-- flag, the newest report's score and its JSON (nil, nil before a report), the
-- progress ms (text) and the suspect-until ms (number, 0 when none).
local function read_newest(text)
  -- (a record with a report has the whole head: one match takes it all)
  local flag, progress, suspect, score, json_start = string.match(text,
    '^(%a)%d* %S+ %d+ (%d+) (%d+)\n(%d+)\t%d+\t()')
  if not flag then
    local rest, _
    flag, rest, score, json_start = string.match(text, '^(%a)%d*([^\n]*)\n(%d+)\t%d+\t()')
    if not flag then
      _, _, progress, suspect = head_fields(string.match(text, '^%a%d*(.*)$'))
      return string.sub(text, 1, 1), nil, nil, progress, suspect
    end
    _, _, progress, suspect = head_fields(rest)
  end
  local line_end = string.find(text, '\n', json_start, true)
  return flag, tonumber(score), string.sub(text, json_start, (line_end or #text + 1) - 1),
    progress, tonumber(suspect)
end

-- The reports of a record, newest first:
--   for score, line in each_report(rec) do ... end
local function each_report(rec)
  local pos = 0 -- 0: the newest is next; else where the next line starts in rec.text
  return function()
    if pos == 0 then
      pos = rec.older_at or #rec.text + 1
      return rec.score, rec.line
    end
    if pos > #rec.text then return nil end
    local line_end = (string.find(rec.text, '\n', pos, true) or #rec.text + 1) - 1
    local line = string.sub(rec.text, pos, line_end)
    pos = line_end + 2
    return line_score(line), line
  end
end

-- The line of the newest report at or before score s, or nil.
local function line_at_or_before(rec, s)
  for score, line in each_report(rec) do
    if score <= s then return line end
  end
  return nil
end

-- The report lines (text, "" if none) that stay behind a new report of this
-- score: a report of the newest one's score (a refresh of the step, or a
-- retry) replaces it; else the new one goes first and the record keeps what a
-- future cut can need: the reports newer than pub and the newest at or before
-- it, at most MAX_HISTORY in all.
local function older_to_keep(rec, score, pub)
  if rec.score == score then
    return rec.older_at and string.sub(rec.text, rec.older_at) or ''
  end
  if not rec.score or score <= pub then return '' end
  if rec.score <= pub then return rec.line end -- (most often)
  local kept = {}
  for kept_score, kept_line in each_report(rec) do
    kept[#kept + 1] = kept_line
    if kept_score <= pub or #kept == MAX_HISTORY - 1 then break end
  end
  return table.concat(kept, '\n')
end

-- Whether a head line is flag and due only: a registered engine's (no
-- incarnation, offset, progress or suspect mark; texts).
local function short_head(inc, offset, progress, suspect)
  return inc == '-' and offset == '0' and progress == '0' and suspect == '0'
end

-- A record's head line, from texts (short_head: flag and due only).
local function format_head(flag, due, inc, offset, progress, suspect)
  if short_head(inc, offset, progress, suspect) then return flag .. due end
  return flag .. due .. ' ' .. inc .. ' ' .. offset .. ' ' .. progress .. ' ' .. suspect
end

-- A record's text: its head line, then the newest report's line and the older
-- lines (text), or no report line (line nil).
local function format_record(head, line, older)
  if not line then return head end
  if older == '' then return head .. '\n' .. line end
  return head .. '\n' .. line .. '\n' .. older
end

-- A record's text with a new report, from texts, in one string (no partial
-- strings on the way: this runs for every report): the head line as
-- format_head writes it, the report's line, then the older lines (text, ""
-- if none). The line: its score, the arrival ms, then the JSON snapshots show:
-- wave and step as includes/args.lua int_arg returns them, waiting, running,
-- kv, admitted and the admitted total as the other checks return them (""
-- admitted or total is left out),
-- t, the ms the counts were made (counted_ms), and the incarnation ("-" is
-- left out).
local function format_report(flag, due, inc, offset, progress, suspect, score, ms, t, wave,
    step, waiting, running, kv, admitted, total, older)
  local sp, head_inc, head_offset, head_progress, head_suspect = ' ', inc, offset, progress,
    suspect
  if short_head(inc, offset, progress, suspect) then
    sp, head_inc, head_offset, head_progress, head_suspect = '', '', '', '', ''
  end
  local adm_open, adm_close = ',"adm":[', ']'
  if admitted == '' then adm_open, adm_close = '', '' end
  local tot_open = ',"tot":'
  if total == '' then tot_open = '' end
  local inc_open, json_inc, inc_close = ',"inc":"', inc, '"'
  if inc == '-' then inc_open, json_inc, inc_close = '', '', '' end
  local older_sep = older == '' and '' or '\n'
  return flag .. due .. sp .. head_inc .. sp .. head_offset .. sp .. head_progress .. sp ..
    head_suspect .. '\n' .. score .. '\t' .. ms .. '\t{"wave":' .. wave .. ',"step":' .. step ..
    ',"waiting":' .. waiting .. ',"running":' .. running .. ',"kv":' .. kv .. ',"t":' .. t ..
    adm_open .. admitted .. adm_close .. tot_open .. total .. inc_open .. json_inc .. inc_close .. '}' .. older_sep ..
    older
end

-- What a compact snapshot (includes/publish.lua) takes of a report's JSON
-- (line_json): waiting, running, kv and t as texts, and the incarnation (nil
-- when the report named none: it is the last field, format_report).
local function json_counts(json)
  local waiting, running, kv, t, rest = string.match(json,
    '"waiting":(%d+),"running":(%d+),"kv":([^,]+),"t":(%d+)()')
  if string.byte(json, -2) ~= 34 then return waiting, running, kv, t, nil end -- no '"}'
  local at = string.find(json, ',"inc":"', rest, true)
  return waiting, running, kv, t, at and string.sub(json, at + 8, -3)
end

-- The t of a new report's JSON: the server ms its counts were made. A report with
-- no progress and the counts of the record's newest report (a heartbeat: the
-- sender re-sends them, under the current tick) keeps that report's t; any other
-- report is made now (now_text). Routers take a report to hold the routes made
-- before its engine's previous one: a re-sent count stamped anew said it held
-- routes it had never seen (docs/DESIGN.md, "What a router holds").
local function counted_ms(rec, e, now_text)
  if e.progress ~= '0' or not rec or not rec.line then return now_text end
  local json = line_json(rec.line)
  local waiting, running, kv, t = json_counts(json)
  if waiting ~= e.waiting or running ~= e.running or kv ~= e.kv then return now_text end
  if (string.match(json, ',"adm":%[([^%]]*)%]') or '') ~= e.admitted then return now_text end
  if (string.match(json, ',"tot":(%d+)') or '') ~= e.total then return now_text end
  return t
end
