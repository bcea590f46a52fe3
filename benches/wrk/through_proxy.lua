-- wrk script: GETs in absolute form (`GET http://target/ HTTP/1.1`) sent to a forward proxy,
-- the gateway or a Squid, which wrk connects to as its "server". EPO_TARGET is the target's
-- URL; EPO_PROXY_AUTH, if set, the Proxy-Authorization header's value.
wrk.path = os.getenv("EPO_TARGET")
local auth = os.getenv("EPO_PROXY_AUTH")
if auth and auth ~= "" then
  wrk.headers["Proxy-Authorization"] = auth
end

dofile("benches/wrk/result.lua")
