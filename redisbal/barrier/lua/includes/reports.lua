--[[
  reports: engines' reports applied to the barrier, the one home of what a
  report does, for report.lua (one engine) and report_many.lua (many engines
  of one deployment in one call).

  An operation checks every report first (check_report: a refusal comes before
  anything is written), then makes one pass over the barrier:
    begin_reports   the barrier's fields and the engines' records, in one read
                    (a new or lost state starts a generation here)
    apply_report    one engine's report, in order; what it changes is kept in
                    the pass, not written
    end_reports     every record and barrier field in one HSET, the heartbeats
                    in one ZADD, the counters; then at most one expiry of dead
                    engines and at most one publish, after every report is in
  An engine appears at most once in a pass (its record is read once).

  What one report does (report.lua's header has its arguments and reply):
  - stale: older than this engine's newest accepted report (counted, nothing
    else changed); conflict: from an incarnation older than the record's
    (refused, counted, conflict:<engine> noted in meta);
  - restart: a later incarnation replaces the record (a leave and a join in
    one step). A restarted lockstep engine, or one whose process started after
    the published step was reached, whose step is at or behind the published
    one starts a new step sequence right after it (its offset), shared by the
    engines that do so within dead_after_ms of each other while it puts them
    at the next step or at most SHARED_SLACK steps behind it, so that a group
    restarting together stays aligned and publishes unforced snapshots again
    (further behind, the sequence is an older group's: sharing it would leave
    them provisional until they caught up, and a clock that keeps pace with
    the cut never does);
  - join: a first report makes a barrier member, or a provisional one when it
    is behind the published step (it cannot hold the barrier back);
  - stall: a heartbeat of an engine with work queued or running whose last
    progress is stall_after_ms old marks it stalled (not waited for, not
    routed to); its next progress brings it back (a suspect mark stays:
    suspect.lua);
  - heartbeat: the engine's score in members is refreshed every
    dead_after_ms / 8, and a pass that refreshed one expires dead engines at
    most every dead_after_ms / 4, so the barrier never waits for a dead engine
    even without a coordinator.
  (docs/DESIGN.md, "Engine lifecycle".)
]]
--- @include "args"
--- @include "deployment"
--- @include "score"
--- @include "record"
--- @include "incarnation"
--- @include "generation"
--- @include "barrier"
--- @include "membership"

-- Whether reports may take the steady-state path (apply_report): tests turn it
-- off to drive the same reports through the general path and compare records.
local STEADY_PATH = true
-- how far behind the next step a shared new sequence may put a process: the
-- steps by which one member's report of a step can trail another's
local SHARED_SLACK = 4

-- One report's arguments, checked (texts, as ARGV gives them; inc and progress
-- and total already defaulted). Returns the report {engine, tick, wave, step,
-- wave_text, step_text, waiting, running, kv, admitted, inc, progress, total}, or nil and the
-- message "bad <field>: ...". (The table is made once, whole: a table grown
-- field by field is rehashed as it grows.)
local function check_report(engine, wave, step, waiting, running, kv, admitted, inc, progress,
    total)
  local kv_json = kv_arg(kv)
  if not kv_json then return nil, 'bad kv_usage: ' .. kv end
  local waiting_text = count_arg(waiting)
  if not waiting_text then return nil, 'bad waiting: ' .. waiting end
  local running_text = count_arg(running)
  if not running_text then return nil, 'bad running: ' .. running end
  local admitted_text = admitted_arg(admitted)
  if not admitted_text then return nil, 'bad admitted: expected comma-separated counts' end
  local total_text = admitted_total_arg(total)
  if not total_text then return nil, 'bad admitted_total: ' .. total end
  if not incarnation_arg(inc) then return nil, 'bad incarnation: ' .. inc end
  if progress ~= '1' and progress ~= '0' then return nil, 'bad progress: ' .. progress end
  local tick = step == 'tick'
  local wave_n, wave_text, step_n, step_text
  if not tick then
    wave_n, wave_text = int_arg(wave, 0, MAX_WAVE)
    if not wave_n then return nil, 'bad wave: ' .. wave end
    step_n, step_text = int_arg(step, 0, STEP_SPAN - 1)
    if not step_n then return nil, 'bad step: ' .. step end
  end
  if not name_arg(engine) then return nil, 'bad engine_id: ' .. engine end
  return {
    engine = engine, tick = tick, wave = wave_n, step = step_n, wave_text = wave_text,
    step_text = step_text, waiting = waiting_text, running = running_text, kv = kv_json,
    admitted = admitted_text, inc = inc, progress = progress, total = total_text,
  }
end

-- A pass over the barrier for the reports of these engines (ids, each once),
-- at server time now (number and text); candidate: the epoch candidate.
-- Returns the pass, or nil and the message (nothing written). The record of
-- engines[i] is p.texts[i + 4] (false when it has none).
local function begin_reports(d, engines, candidate, now, now_text)
  local h = redis.call('HMGET', d.reports, '.pub', '.since', '.behind', '.next_reap',
    unpack(engines))
  if not h[1] then -- no .pub: the state is new or was lost
    if not new_generation(d, candidate, now) then return nil, 'bad epoch candidate' end
    h = {'-1', false, '0', false}
  end
  local behind = tonumber(h[3]) or 0
  -- (the lists and tables a report rarely needs are made when first used)
  return {
    deployment = d, now = now, now_text = now_text, texts = h, fields = {},
    pub = tonumber(h[1]), behind = behind, old_behind = behind,
    since = h[2] and true or false, next_reap = h[4],
  }
end

-- One deployment setting, read once per pass.
local function pass_setting(p, name)
  if not p.settings then p.settings = {} end
  local v = p.settings[name]
  if not v then
    v = config_value(p.deployment, name)
    p.settings[name] = v
  end
  return v
end

-- The server's tick at the pass's time (one for all its reports): wave, step and
-- their texts.
local function pass_tick(p)
  local t = p.tick
  if not t then
    local wave, step = from_score(math.floor(p.now / pass_setting(p, 'tick_ms')))
    t = {wave, step, int_text(wave), int_text(step)}
    p.tick = t
  end
  return t[1], t[2], t[3], t[4]
end

-- Add n to a counter in meta at the end of the pass.
local function pass_count(p, field)
  if not p.counters then p.counters, p.counter_names = {}, {} end
  if not p.counters[field] then
    p.counters[field] = 0
    p.counter_names[#p.counter_names + 1] = field
  end
  p.counters[field] = p.counters[field] + 1
end

local function push2(t, a, b)
  t[#t + 1], t[#t + 2] = a, b
end

-- The list p[name], made when first used.
local function pass_list(p, name)
  local t = p[name]
  if not t then
    t = {}
    p[name] = t
  end
  return t
end

-- A member counts in .behind while its newest report is at or before pub.
local function counted(flag, score, pub)
  return flag == 'b' and (not score or score <= pub)
end

-- The heartbeat due ms (text) a record keeps: due, or, when it has come, the
-- next one (every dead_after_ms / 8), the engine's heartbeat refreshed in members.
local function heartbeat_due(p, engine, due)
  local now_text = p.now_text
  if #due == #now_text then -- (whole ms of one length: compared as texts, no tonumber)
    if now_text < due then return due end
  elseif p.now < (tonumber(due) or 0) then
    return due
  end
  push2(pass_list(p, 'heartbeats'), now_text, engine)
  return int_text(p.now + math.floor(pass_setting(p, 'dead_after_ms') / 8))
end

-- The steady state of a lockstep engine, without taking its record apart: a
-- barrier member with no suspect mark, reporting progress under its record's
-- incarnation (or none) past pub while its newest report is at or before pub.
-- What the general path does then, in apply_report: the member leaves .behind,
-- the head gets the new progress ms (and heartbeat due), the new report goes
-- first and the newest old one stays behind it. Returns the reply, or nil when
-- the report is not that case (nothing done).
local function apply_steady(p, e, text, raw, wave, step, wave_text, step_text)
  -- (patterns only over the head; the line is cut with plain finds)
  local due, inc, offset, line_start, newest = string.match(text,
    '^b(%d*) (%S+) (%d+) %d+ 0\n()(%d+)\t')
  if not due or (e.inc ~= inc and e.inc ~= '-') then return nil end
  local pub = p.pub
  local score = offset == '0' and raw or raw + tonumber(offset)
  if score <= pub or score >= 2 ^ 53 or tonumber(newest) > pub then return nil end
  local line_end = string.find(text, '\n', line_start + #newest, true)
  local line = string.sub(text, line_start, (line_end or #text + 1) - 1)
  p.behind = p.behind - 1
  local engine = e.engine
  due = heartbeat_due(p, engine, due)
  local score_text = score == raw and wave == 0 and step_text or int_text(score)
  push2(p.fields, engine, format_report('b', due, inc, offset, p.now_text, '0', score_text,
    p.now_text, p.now_text, wave_text, step_text, e.waiting, e.running, e.kv, e.admitted, e.total, line))
  p.publish_due = true
  if not p.since then p.since, p.since_set = true, true end
  return {'accepted', 0, wave, step}
end

-- Apply the checked report e (check_report) of the pass's i-th engine in pass
-- p. Returns the reply {status, 0, wave, step[, record's incarnation]} (the
-- operation fills in the version), or nil and the message when the report is
-- refused.
local function apply_report(p, i, e)
  local d, now, now_text, pub = p.deployment, p.now, p.now_text, p.pub
  local engine, inc, progress = e.engine, e.inc, e.progress
  local wave, step, wave_text, step_text = e.wave, e.step, e.wave_text, e.step_text
  if e.tick then wave, step, wave_text, step_text = pass_tick(p) end
  local raw = to_score(wave, step) -- the engine's own order; + the record's offset: ours
  local text = p.texts[i + 4]
  if STEADY_PATH and text and progress == '1' then
    local reply = apply_steady(p, e, text, raw, wave, step, wave_text, step_text)
    if reply then return reply end
  end
  local rec = text and parse_record(text)
  local changed, restarted = false, false

  if rec and inc ~= '-' and rec.inc ~= '-' and inc ~= rec.inc then
    if started_before(inc, rec.inc) then -- a process older than the record's: refused
      pass_count(p, 'conflicts')
      push2(pass_list(p, 'meta_set'), 'conflict:' .. engine, now_text .. ' ' .. inc .. ' ' .. rec.inc)
      return {'conflict', 0, wave, step, rec.inc}
    end
    -- a restart: the old record leaves, this report joins
    if counted(rec.flag, rec.score, pub) then p.behind = p.behind - 1 end
    pass_count(p, 'restarted')
    push2(pass_list(p, 'meta_del'), 'stale:' .. engine, 'suspect:' .. engine)
    rec, changed, restarted = nil, true, true
  end

  -- the offset into the deployment's order: the record's, or a new step sequence
  -- for a lockstep process whose counter cannot be part of the published one: a
  -- restart, or a process started after pub was reached. The engines that do so
  -- within dead_after_ms of each other share one sequence (a group restarting
  -- together stays aligned), as long as it puts them at pub + 1 or at most
  -- SHARED_SLACK behind (further, it is an older group's sequence). A
  -- process that was part of the published sequence (a group member joining a
  -- few steps late, an engine that comes back) keeps its steps: provisional.
  local offset = rec and rec.offset or '0'
  if (not rec or not rec.score) and inc ~= '-' and not e.tick and pub >= 0 and raw <= pub then
    if not p.rebase then
      p.rebase = redis.call('HMGET', d.reports, '.rebase', '.rebase_ms', '.pub_at')
    end
    local r = p.rebase
    local shared = tonumber(r[1])
    if shared and now - tonumber(r[2]) < pass_setting(p, 'dead_after_ms')
      and shared + raw <= pub + 1 and shared + raw + SHARED_SLACK >= pub + 1 then
      offset = r[1]
    elseif restarted or started_ms(inc) >= (tonumber(r[3]) or now) then
      offset = int_text(pub + 1 - raw)
      r[1], r[2], p.rebase_set = offset, now_text, true
    end
  end
  local score = raw + tonumber(offset)
  if score >= 2 ^ 53 then return nil, 'bad step: past the order a number holds; start a new epoch' end

  -- older than this engine's newest accepted report: stale
  if rec and rec.score and score < rec.score then
    pass_count(p, 'stale')
    pass_count(p, 'stale:' .. engine)
    return {'stale', 0, wave, step}
  end

  -- the new record's head and its older lines
  local flag, due, older, last_progress, suspect = 'b', '0', '', now_text, '0'
  if not rec then
    -- a joiner: a barrier member, unless it is behind the published step, when it
    -- stays provisional so that it cannot hold the barrier back
    if score < pub then flag = 'p' end
    pass_count(p, 'joined')
  else
    if counted(rec.flag, rec.score, pub) then p.behind = p.behind - 1 end
    flag, due, older = rec.flag, rec.due, older_to_keep(rec, score, pub)
    if rec.inc ~= '-' and inc == '-' then inc = rec.inc end
    if progress == '0' and rec.progress ~= '0' then last_progress = rec.progress end
    -- a suspect mark stays: only a router that saw the engine answer clears it
    -- (recovered.lua), never its own reports (outcomes over self-reports)
    if rec.suspect ~= 0 then suspect = int_text(rec.suspect) end
    if flag == 's' then
      if progress == '1' then -- it stepped again
        flag, changed = score >= pub and 'b' or 'p', true
      end
    elseif score >= pub then
      flag = 'b' -- a provisional joiner that reaches pub joins the barrier
    end
    if rec.score and score ~= rec.score and score <= pub then pass_count(p, 'late') end
    -- a heartbeat of an engine with work whose loop has not progressed: stalled
    if progress == '0' and flag ~= 's' and (e.waiting ~= '0' or e.running ~= '0')
      and now - tonumber(last_progress) >= pass_setting(p, 'stall_after_ms') then
      flag, changed = 's', true
      pass_count(p, 'stalled')
    end
  end
  if counted(flag, score, pub) then p.behind = p.behind + 1 end

  -- the heartbeat in members is refreshed every dead_after_ms / 8
  due = heartbeat_due(p, engine, due)
  local score_text = score == raw and wave == 0 and step_text or int_text(score)
  push2(p.fields, engine, format_report(flag, due, inc, offset, last_progress, suspect,
    score_text, now_text, counted_ms(rec, e, now_text), wave_text, step_text, e.waiting,
    e.running, e.kv, e.admitted, e.total, older))
  if flag == 'b' and score > pub then
    p.publish_due = true
    if not p.since then p.since, p.since_set = true, true end
  elseif pub < 0 then
    p.publish_due = true
  end
  if changed then p.changed = true end
  return {'accepted', 0, wave, step}
end

-- End pass p: write what its reports changed, expire dead engines when a
-- heartbeat was refreshed and a reap is due (every dead_after_ms / 4), then
-- publish if the barrier completed, or republish after a membership change.
-- Returns the version published, 0 if none.
local function end_reports(p)
  local d, now, fields = p.deployment, p.now, p.fields
  if p.behind ~= p.old_behind then push2(fields, '.behind', p.behind) end
  if p.since_set then push2(fields, '.since', p.now_text) end
  if p.rebase_set then
    push2(fields, '.rebase', p.rebase[1])
    push2(fields, '.rebase_ms', p.rebase[2])
  end
  local reap_due = p.heartbeats and now >= (tonumber(p.next_reap) or 0)
  local dead_after = reap_due and pass_setting(p, 'dead_after_ms')
  if reap_due then push2(fields, '.next_reap', now + math.floor(dead_after / 4)) end
  if #fields > 0 then redis.call('HSET', d.reports, unpack(fields)) end
  if p.heartbeats then redis.call('ZADD', d.members, unpack(p.heartbeats)) end
  local names = p.counter_names
  if names then
    for i = 1, #names do redis.call('HINCRBY', d.meta, names[i], p.counters[names[i]]) end
  end
  if p.meta_del then redis.call('HDEL', d.meta, unpack(p.meta_del)) end
  if p.meta_set then redis.call('HSET', d.meta, unpack(p.meta_set)) end

  local changed = p.changed
  if reap_due and #expire_engines(d, dead_after, now, 8) > 0 then changed = true end
  if changed then return publish_after_change(d, now) end
  if p.publish_due and p.behind <= 0 then return maybe_publish(d, now) end
  return 0
end
