--[[
  library.lua: run once by a function library (Redis 7), after common.lua; never
  by an EVAL script (redisbal/scripts.py). It fills in what a library keeps between
  calls, so that the report path looks texts up instead of checking or formatting
  them again: a Lua C call costs 500 to 2,700 instructions in Redis's build, a
  table lookup about 120 (docs/BENCHMARKS.md). The names are common.lua's locals.

  kv_ok      kv_usage texts that passed the report's check as they are ("0.4000")
  counts_ok  waiting and running texts below 10^9 in canonical decimal
  steps_ok   step texts likewise: one repeats for every engine of a step, then
             never again, so steps have a small table of their own
  id_keys    engine id -> its key text in a snapshot (',"<id>":')
  int_texts  whole number -> its decimal text (.behind goes to HSET as text:
             Redis formats a Lua number argument with "%.17g")

  Every table is bounded (emptied when full) and kept small: the Lua heap is what
  Redis's garbage collector walks every 50 calls, so a large one costs every call.
]]

LIBRARY = true

kv_ok, counts_ok, steps_ok, id_keys, int_texts = {}, {}, {}, {}, {}
local limits = {[kv_ok] = 1024, [counts_ok] = 1024, [steps_ok] = 64, [id_keys] = 4096}
local sizes = {[kv_ok] = 0, [counts_ok] = 0, [steps_ok] = 0, [id_keys] = 0}

-- t[key] = value in one of the bounded tables (a false value remembers nothing)
function remember(t, key, value)
  if not value or t[key] ~= nil then return end
  if sizes[t] >= limits[t] then
    for k in pairs(t) do t[k] = nil end
    sizes[t] = 0
  end
  t[key], sizes[t] = value, sizes[t] + 1
end

-- the decimal text of a whole number, for a command argument
function itext(n)
  local t = int_texts[n]
  if t then return t end
  t = string.format('%d', n)
  if n >= 0 and n < 4096 then int_texts[n] = t end
  return t
end
