--[[
  record: an engine's record, the value of its field in the reports hash, read
  and written only here (and, for Python, only by redisbal/record.py; the
  format is in docs/DESIGN.md).

    <flag><heartbeat due ms>
    <score>\t<report ms>\t<json>        the newest report
    <score>\t<report ms>\t<json>        older ones, newest first

  flag "b": a barrier member; "p": a provisional joiner (it joined behind the
  published step: it is in snapshots but the barrier does not wait for it).
  The heartbeat due ms is when a report next refreshes the engine's heartbeat
  in the members zset. A registered engine that has not reported yet has the
  head line only. <score> is the report's tag (includes/score.lua), <report ms>
  the server time it arrived, <json> what a snapshot shows for the engine:
    {"wave":W,"step":S,"waiting":N,"running":N,"kv":X,"t":MS,"adm":[N,...]}
  (kv is a number in [0, 1] or null; "adm", the admitted counts per API
  server, only when the engine sent them).

  Kept: every report newer than the published score and the newest one at or
  before it, which is exactly what any future cut can need (MAX_HISTORY at most).

  In Lua, parse_record gives a read-only view of a record's text:
    {flag = 'b', due = text, score = number, line = text, text = text, older_at = n}
  due: the heartbeat due ms as text; score and line: the newest report's score
  and line (nil before the first report); older_at: where the older lines start
  in text (nil if none). An operation takes a record apart only as far as it
  needs and writes a new text with format_record: texts are kept as read (a
  number's text costs a sprintf).
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

-- The view of a record's text (above).
local function parse_record(text)
  -- the head line, where the newest report's line starts, and its score
  local flag, due, line_start, score = string.match(text, '^(.)(%d*)\n()(%d+)\t')
  if not flag then -- registered, no report yet
    return {flag = string.sub(text, 1, 1), due = string.sub(text, 2), text = text}
  end
  local line_end = string.find(text, '\n', line_start, true)
  return {
    flag = flag, due = due, score = tonumber(score), text = text,
    line = string.sub(text, line_start, (line_end or #text + 1) - 1),
    older_at = line_end and line_end + 1,
  }
end

-- What a publish reads of every engine, without taking its record apart: the
-- flag, the newest report's score and its JSON (nil, nil before a report).
local function read_newest(text)
  local flag, score, json_start = string.match(text, '^(.)%d*\n(%d+)\t%d+\t()')
  if not flag then return string.sub(text, 1, 1), nil, nil end
  local line_end = string.find(text, '\n', json_start, true)
  return flag, tonumber(score), string.sub(text, json_start, (line_end or #text + 1) - 1)
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

-- A record's text: flag, heartbeat due ms (text), then the newest report's line
-- and the older lines (text), or no report line (line nil).
local function format_record(flag, due, line, older)
  if not line then return flag .. due end
  if older == '' then return flag .. due .. '\n' .. line end
  return flag .. due .. '\n' .. line .. '\n' .. older
end

-- A new report's line, from texts: its score, the arrival ms, then the JSON
-- snapshots show: wave and step as includes/args.lua int_arg returns them,
-- waiting, running, kv and admitted as the other checks return them ("" admitted
-- is left out).
local function format_line(score, ms, wave, step, waiting, running, kv, admitted)
  local adm = ''
  if admitted ~= '' then adm = ',"adm":[' .. admitted .. ']' end
  return score .. '\t' .. ms .. '\t{"wave":' .. wave .. ',"step":' .. step ..
    ',"waiting":' .. waiting .. ',"running":' .. running .. ',"kv":' .. kv ..
    ',"t":' .. ms .. adm .. '}'
end
