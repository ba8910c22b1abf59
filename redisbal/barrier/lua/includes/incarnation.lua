--[[
  incarnation: which process reports for an engine. A reporter names itself
  when it is made: "<start ms in base 36>-<random hex>" (redisbal/reporting/reporter.py), so
  that a process started later orders after one started earlier (ties: by the
  text). A report from a later incarnation than the engine's record is a
  restart: it replaces the record. One from an earlier incarnation comes from a
  process that was replaced, or that runs beside the newer one under the same
  engine id: a conflict, refused. "-" names no incarnation (a client that does
  not send one): taken as the engine's current one.
]]

-- The incarnation text, or nil when it is not "-" and not "<base36>-<hex>" of at
-- most 40 characters.
local function incarnation_arg(s)
  if s == '-' then return s end
  if #s > 40 or not string.find(s, '^%w%w?%w?%w?%w?%w?%w?%w?%w?%w?%w?%w?%-%x+$') then
    return nil
  end
  return s
end

-- The ms an incarnation (not "-") was started, by its host's clock.
local function started_ms(inc)
  return tonumber(string.match(inc, '^(%w+)'), 36)
end

-- Whether incarnation a was started before incarnation b (neither "-").
local function started_before(a, b)
  local a_ms, b_ms = started_ms(a), started_ms(b)
  if a_ms ~= b_ms then return a_ms < b_ms end
  return a < b
end
