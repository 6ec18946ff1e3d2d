-- flowctl's lease allocator (flowctl/src/fleet/global/allocator.rs is the
-- same algorithm in Rust; a differential test holds them to the same
-- outputs). Run atomically by Redis, with Redis TIME as the only clock.
--
-- KEYS[1]      the rule's record: a hash {epoch, learn}
-- KEYS[2..]    the cells, one hash per (rule, key): field "learn" (the
--              cell's learning deadline) and one field "h:<host>" per host,
--              "gr,gb,gq,ar,ab,aq,demand,expires,seq,used,used_until"
--              (granted and acked rate, burst and quota shares; the quota
--              the host had used in its window, reserved until used_until).
--              All keys share one {hash tag} (the rule), so a batch is one
--              slot.
-- ARGV         L, B, Q, lease (us), candidate epoch, host, seq, quota
--              window (us), then per cell: held rate, held burst, held
--              quota, demand, used, used_for (us until used has left the
--              window, at most the quota window).
-- Returns      {epoch, then per cell: fresh, rate, burst, quota, target,
--              expires (us, Redis clock), learning}.
--
-- Lua 5.1 numbers are doubles: every amount is at most 2^32 - 1 and every
-- product below 2^53, so the arithmetic is exact; idiv is floor division
-- corrected for the rounding of a / b.

local SHARE_ONE = 1048576
local MAX_AMOUNT = 4294967295

local function idiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

local function fmt(x)
  return string.format('%d', x)
end

local function proportion(total, part, whole)
  if whole == 0 then
    return 0
  end
  local w = idiv(part * SHARE_ONE, whole)
  return idiv(total * w, SHARE_ONE)
end

-- Demand-weighted max-min fair share (allocator.rs, fair_share).
local function fair(cap, demands, mine)
  if mine == 0 then
    return 0
  end
  local total = 0
  for _, d in ipairs(demands) do
    total = total + d
  end
  if total <= cap then
    local w = idiv(mine * SHARE_ONE, total)
    return mine + idiv((cap - total) * w, SHARE_ONE)
  end
  local sorted = {}
  for _, d in ipairs(demands) do
    if d > 0 then
      sorted[#sorted + 1] = d
    end
  end
  table.sort(sorted)
  local rem, k = cap, #sorted
  for _, d in ipairs(sorted) do
    if d * k > rem then
      break
    end
    rem = rem - d
    k = k - 1
  end
  if k < 1 then
    k = 1
  end
  return math.min(mine, idiv(rem, k))
end

-- An entry of nine numbers (written before quotas were split) has
-- nothing used.
local function decode(v)
  local e = {}
  for x in string.gmatch(v, '[^,]+') do
    e[#e + 1] = tonumber(x)
  end
  e[10] = e[10] or 0
  e[11] = e[11] or 0
  return e
end

local function encode(e)
  local parts = {}
  for i = 1, 11 do
    parts[i] = fmt(e[i])
  end
  return table.concat(parts, ',')
end

-- What an entry keeps from the others (allocator.rs, Entry::reserved):
-- max(granted, acked) while its lease lives, and its used quota while that
-- is in a window.
local function reserved(e, now)
  local r = { 0, 0, 0 }
  if e[8] > now then
    r = { math.max(e[1], e[4]), math.max(e[2], e[5]), math.max(e[3], e[6]) }
  end
  if e[11] > now then
    r[3] = math.max(r[3], e[10])
  end
  return r
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local L, B, Q = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local lease = tonumber(ARGV[4])
local host, seq = ARGV[6], tonumber(ARGV[7])
local qwindow = tonumber(ARGV[8])
local hfield = 'h:' .. host

-- The rule's record; a missing one (new or flushed store) learns for a lease.
local meta_epoch = redis.call('HGET', KEYS[1], 'epoch')
local meta_learn
if not meta_epoch then
  meta_epoch = ARGV[5]
  meta_learn = now + lease
  redis.call('HSET', KEYS[1], 'epoch', meta_epoch, 'learn', fmt(meta_learn))
else
  meta_learn = tonumber(redis.call('HGET', KEYS[1], 'learn') or '0')
end

local out = { meta_epoch }
for i = 2, #KEYS do
  local key = KEYS[i]
  local base = 9 + (i - 2) * 6
  local held = {
    math.min(tonumber(ARGV[base]), MAX_AMOUNT),
    math.min(tonumber(ARGV[base + 1]), MAX_AMOUNT),
    math.min(tonumber(ARGV[base + 2]), MAX_AMOUNT),
  }
  local demand = math.min(tonumber(ARGV[base + 3]), MAX_AMOUNT)
  local used = math.min(tonumber(ARGV[base + 4]), MAX_AMOUNT)
  local used_for = math.min(tonumber(ARGV[base + 5]), qwindow)

  -- 1. Read the cell, dropping leases that ended (an entry whose used
  -- quota is still in a window lingers with only that).
  local raw = redis.call('HGETALL', key)
  local learn = 0
  local hosts = {}
  for j = 1, #raw, 2 do
    local f, v = raw[j], raw[j + 1]
    if f == 'learn' then
      learn = tonumber(v)
    elseif string.sub(f, 1, 2) == 'h:' then
      local e = decode(v)
      if e[8] > now or (e[10] > 0 and e[11] > now) then
        hosts[f] = e
      end
    end
  end

  local mine = hosts[hfield]
  local fresh, grant, target, expires, learning
  if mine and seq <= mine[9] then
    -- 2. Stale: nothing changes.
    fresh, target, expires = 0, 0, mine[8]
    grant = { mine[1], mine[2], mine[3] }
    learning = math.max(meta_learn, learn) > now
  else
    -- 3. Holding more than the cell reserves: state was lost.
    local res = { 0, 0, 0 }
    if mine then
      res = reserved(mine, now)
    end
    if held[1] > res[1] or held[2] > res[2] or held[3] > res[3] then
      learn = math.max(learn, now + lease)
    end
    learning = math.max(meta_learn, learn) > now

    -- 4. What the others keep; 5. the fair share.
    local others = { 0, 0, 0 }
    local demands = {}
    for f, e in pairs(hosts) do
      if f ~= hfield then
        local r = reserved(e, now)
        others[1] = others[1] + r[1]
        others[2] = others[2] + r[2]
        others[3] = others[3] + r[3]
        -- Only live leases compete (a lingering entry asks for nothing).
        if e[8] > now then
          demands[#demands + 1] = e[7]
        end
      end
    end
    demands[#demands + 1] = demand
    local free = { math.max(L - others[1], 0), math.max(B - others[2], 0), math.max(Q - others[3], 0) }
    target = fair(L, demands, demand)

    -- 6. The grant, never more than the others leave.
    if learning then
      grant = { math.min(held[1], free[1]), math.min(held[2], free[2]), math.min(held[3], free[3]) }
    else
      local rate = math.min(target, free[1])
      grant = { rate, math.min(math.max(proportion(B, rate, L), math.min(rate, 1)), free[2]), math.min(proportion(Q, rate, L), free[3]) }
    end
    -- A rate share needs a unit of burst to admit anything (allocator.rs,
    -- usable): without one, no rate either.
    if grant[1] > 0 and grant[2] == 0 then
      grant[1] = 0
    end
    expires = now + lease
    if grant[1] + grant[2] + grant[3] == 0 and held[1] + held[2] + held[3] == 0 and demand == 0 and used == 0 then
      hosts[hfield] = nil
    else
      local used_until = 0
      if used > 0 then
        used_until = now + used_for
      end
      hosts[hfield] = { grant[1], grant[2], grant[3], held[1], held[2], held[3], demand, expires, seq, used, used_until }
    end
    fresh = 1
  end

  -- Write the cell back whole; it lives as long as its last lease.
  redis.call('DEL', key)
  local keep = learn
  local args = {}
  for f, e in pairs(hosts) do
    args[#args + 1] = f
    args[#args + 1] = encode(e)
    if e[8] > keep then
      keep = e[8]
    end
    if e[11] > keep then
      keep = e[11]
    end
  end
  if #args > 0 or learn > now then
    redis.call('HSET', key, 'learn', fmt(learn))
    -- In chunks: unpack() of thousands of hosts would overflow Lua's stack.
    for j = 1, #args, 200 do
      redis.call('HSET', key, unpack(args, j, math.min(j + 199, #args)))
    end
    redis.call('PEXPIRE', key, idiv(keep - now, 1000) + 1000)
  end

  out[#out + 1] = fresh
  out[#out + 1] = grant[1]
  out[#out + 1] = grant[2]
  out[#out + 1] = grant[3]
  out[#out + 1] = target
  out[#out + 1] = expires
  out[#out + 1] = learning and 1 or 0
end
return out
