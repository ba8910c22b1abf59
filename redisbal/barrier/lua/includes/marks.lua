--[[
  marks: what suspect.lua and recovered.lua share. Both name an engine and the
  calling API server's client index, and act only on an engine that reported in
  this epoch: they read its record the same way.
]]
--- @include "args"
--- @include "deployment"
--- @include "record"

-- ARGV[3] engine id, ARGV[4] client index (0..4095) or "-": the engine and the
-- client's text, or nil, nil and the refusal
local function mark_args(argv)
  local engine = name_arg(argv[3])
  if not engine then return nil, nil, 'bad engine_id: ' .. argv[3] end
  local client_text = argv[4]
  if client_text ~= '-' and not int_arg(client_text, 0, 4095) then
    return nil, nil, 'bad client index: ' .. client_text
  end
  return engine, client_text
end

-- the engine's record text and its parsed record, or nil when the engine has
-- not reported in this epoch (the operation's "unknown")
local function reported_record(d, engine)
  if not redis.call('HGET', d.reports, '.epoch') then return nil end
  local text = redis.call('HGET', d.reports, engine)
  local rec = text and parse_record(text)
  if not rec or not rec.score then return nil end
  return text, rec
end
