-- wrk script: acquire->release pairs against the discovery API (or the bare baseline, which
-- answers with the same shapes). Every 201 queues its lease; the next request written (on the
-- same connection, in practice) releases it, else a new acquire is sent.
local token = os.getenv("EPO_TOKEN") or "bench-token"
local headers = {
  ["Authorization"] = "Bearer " .. token,
  ["Content-Type"] = "application/json",
}
local acquire = wrk.format("POST", "/v1/leases", headers,
  '{"holder":"bench","selector":{"tier":"dc"},"ttlSeconds":60}')
local queue, head, tail = {}, 1, 0

function request()
  if head <= tail then
    local lease = queue[head]
    queue[head] = nil
    head = head + 1
    return wrk.format("POST", "/v1/leases/" .. lease[1] .. "/release", headers,
      '{"fencingToken":' .. lease[2] .. ',"outcome":"ok"}')
  end
  return acquire
end

function response(status, _, body)
  if status == 201 then
    local id, fencing = body:match('"leaseId":"([^"]+)","fencingToken":(%d+)')
    if id then
      tail = tail + 1
      queue[tail] = { id, fencing }
    end
  end
end

dofile("benches/wrk/result.lua")
