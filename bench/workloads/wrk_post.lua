-- wrk script: POST a fresh instance body (a unique name) per request; prints a JSON summary.
local tag = os.getenv("BENCH_TAG") or "x"
local key = os.getenv("BENCH_KEY") or ""
local path = os.getenv("BENCH_PATH") or "/"
local threads = 0
local n = 0

function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end

function init(args)
  wrk.headers["Content-Type"] = "application/json"
  if key ~= "" then
    wrk.headers["Authorization"] = "Bearer " .. key
  end
end

function request()
  n = n + 1
  local body = string.format('{"name":"b%s-%d-%d","plan":"dev"}', tag, tid, n)
  return wrk.format("POST", path, nil, body)
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests":%d,"duration_us":%d,"status_errors":%d,"socket_errors":%d,"p50_us":%d,"p99_us":%d}\n',
    summary.requests, summary.duration, e.status, e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
