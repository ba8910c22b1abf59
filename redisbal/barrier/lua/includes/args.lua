--[[
  args: checking what a caller sent in ARGV.

  ARGV entries are always strings. Every check returns the value to use (a
  number, or the text to store) or nil when the argument is refused; the
  operation then returns fail('bad <field>: ...') before it has written
  anything. The scripts check everything themselves: a
  client that bypasses the Python checks (another language, a bug, an attacker
  with access to Redis) gets the same refusals.
]]

local MAX_COUNT = 1000000000 -- bound of waiting and running
local MAX_ADMITTED_LEN = 65536
local MAX_TOTAL_LEN = 15 -- admitted_total below 10^15 (routing/admit_total.py MAX_TOTAL)
local NAME_PATTERN = '^%w[%w_.%-]*$' -- the Python side's keys.NAME_RE

-- The error reply of every refusal: "redisbal: <message>".
local function fail(message)
  return redis.error_reply('ERR redisbal: ' .. message)
end

-- The decimal text of a whole number (string.format, unlike tostring, never
-- writes an exponent).
local function int_text(n)
  return string.format('%.0f', n)
end

-- Whether s is a whole number in canonical decimal: "0", or digits without a
-- leading zero (what the reporters send; JSON as it is).
local function is_canonical_int(s)
  return s == '0' or string.find(s, '^[1-9]%d*$') ~= nil
end

-- A whole number in [lo, hi]: optional "-", digits (leading zeros allowed), at
-- most 16 characters. Returns the number and its canonical text, or nil.
local function int_arg(s, lo, hi)
  if s == '0' and lo <= 0 then return 0, s end -- (the usual wave)
  if #s > 16 then return nil end
  local canonical = is_canonical_int(s)
  if not canonical and not string.find(s, '^%-?%d+$') then return nil end
  local n = tonumber(s)
  if n < lo or n > hi then return nil end
  if canonical then return n, s end
  return n, int_text(n)
end

-- A deployment, engine, epoch or owner name: 1 to 64 characters from letters,
-- digits, "_", "." and "-", starting with a letter or digit. Returns it or nil.
local function name_arg(s)
  if #s > 64 or not string.find(s, NAME_PATTERN) then return nil end
  return s
end

-- A count (waiting, running) in 0..MAX_COUNT, digits only. Returns its
-- canonical text ("007" gives "7"), ready for JSON, or nil.
local function count_arg(s)
  if #s > 10 then return nil end
  if is_canonical_int(s) then
    if #s == 10 and tonumber(s) > MAX_COUNT then return nil end -- (shorter is below)
    return s
  end
  if not string.find(s, '^%d+$') or tonumber(s) > MAX_COUNT then return nil end
  return int_text(tonumber(s))
end

-- kv_usage: "" when unknown, else a decimal in [0, 1]. Returns its JSON text:
-- "null" for "", the text itself for "0", "1" and "0.d" with at most four
-- decimals (what the reporters send), any other spelling (".5", "1.0") as
-- "%.4f". Nil when refused.
local function kv_arg(s)
  if s == '' then return 'null' end
  if s == '0' or s == '1' or string.find(s, '^0%.%d%d?%d?%d?$') then return s end
  if #s > 24 or not string.find(s, '^%d*%.?%d+$') then return nil end
  local v = tonumber(s)
  if v < 0 or v > 1 then return nil end
  return string.format('%.4f', v)
end

-- admitted: "" (not reported) or comma-separated cumulative counts, one per API
-- server, each "0" or digits without a leading zero, so that the list is valid
-- JSON as it is. An entry's length is not bounded here: the reporters refuse
-- counts >= 10^15 and routers read a list that sums past that as not reported.
-- Returns the text or nil.
local function admitted_arg(s)
  if s == '' then return s end
  -- digits and commas, no empty entry: a digit first, no "," last, no ",,"
  if #s > MAX_ADMITTED_LEN or not string.find(s, '^%d[%d,]*$') or string.byte(s, -1) == 44
    or string.find(s, ',,', 1, true) then
    return nil
  end
  -- a leading zero: an entry starting with "0" and going on with a digit
  if string.find(s, '^0%d') then return nil end
  local zero = string.find(s, ',0', 1, true)
  while zero do
    if string.find(s, '^%d', zero + 2) then return nil end
    zero = string.find(s, ',0', zero + 2, true)
  end
  return s
end

-- admitted_total: "" (not reported) or the engine's cumulative count of requests
-- taken in (finished + waiting + running), "0" or digits without a leading zero,
-- below 10^15. Returns the text or nil.
local function admitted_total_arg(s)
  if s == '' then return s end
  if #s > MAX_TOTAL_LEN or not is_canonical_int(s) then return nil end
  return s
end
