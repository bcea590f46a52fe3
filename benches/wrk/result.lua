-- The line every wrk run of the benchmarks ends with, for the shell scripts to read.
function done(summary, latency, _)
  local e = summary.errors
  io.write(string.format(
    "RESULT requests=%d seconds=%.3f non2xx=%d socket_errors=%d p50_us=%d p99_us=%d p999_us=%d max_us=%d\n",
    summary.requests, summary.duration / 1e6, e.status, e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(99), latency:percentile(99.9), latency.max))
end
