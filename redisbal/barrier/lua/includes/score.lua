--[[
  score: a report's tag (wave, step) as one number, so that tags compare as
  numbers, waves first: score = wave * 2^32 + step. With wave < 2^20 a score
  stays below 2^52, exact in a Lua number (a double).

  In tick mode an engine has no steps of its own: its report is tagged with the
  server's tick, floor(server ms / tick_ms), a score like any other, which
  reads as (wave, step) = divmod(tick, 2^32): what counts is the order.
]]

local STEP_SPAN = 4294967296 -- 2^32: steps per wave
local MAX_WAVE = 1048575 -- 2^20 - 1

local function to_score(wave, step)
  return wave * STEP_SPAN + step
end

-- wave, step of a score
local function from_score(score)
  local wave = math.floor(score / STEP_SPAN)
  return wave, score - wave * STEP_SPAN
end
