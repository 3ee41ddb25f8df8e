"""CPU per call of the per-round paths the round-overhead change touched, in-process, on one thread:
    PYTHONPATH=TREE python docs/results/emulated-2026-12-02-round-overhead/round_paths.py"""
import asyncio, time
from types import SimpleNamespace
import grpc
from specmesh.server.telemetry import server_message_span, client_message_span
from specmesh.server.grpc_server import ErrorInterceptor
from specmesh.server.drain import Drain, DrainInterceptor
from specmesh.server.metrics import OrchestratorMetrics, RequestRecorder
from specmesh.v1 import target_pb2

N = 20000
def cpu_us(fn, n=N):
    for _ in range(200): fn()
    t = time.process_time()
    for _ in range(n): fn()
    return (time.process_time() - t) / n * 1e6

request = target_pb2.VerifyRequest(request_id="r", round=3, position=100, draft_token_ids=[1, 2, 3, 4])
def spans():
    with server_message_span(None, "/m", request):
        pass
    with client_message_span(None, "/m", request):
        pass
print(f"round-stream spans, tracing off (client + server, per message): {cpu_us(spans):.1f} us")

async def behaviour(request, context): return None
handler = grpc.unary_stream_rpc_method_handler(lambda r, c: None, request_deserializer=target_pb2.VerifyRequest.FromString)
async def gen(r, c):
    yield None
handler = handler._replace(unary_stream=gen)
chain_error, chain_drain = ErrorInterceptor(), DrainInterceptor(Drain(), ["specmesh.v1.DraftService"])
details = SimpleNamespace(method="/specmesh.v1.DraftService/PreDraft", invocation_metadata=())
async def inner(d): return handler
async def drained(d): return await chain_drain.intercept_service(inner, d)
async def intercept_many(n):
    for _ in range(n):
        await chain_error.intercept_service(drained, details)
loop = asyncio.new_event_loop()
loop.run_until_complete(intercept_many(200))
t = time.process_time(); loop.run_until_complete(intercept_many(N))
print(f"error + drain interceptors, per call: {(time.process_time() - t) / N * 1e6:.1f} us")

recorder = RequestRecorder(OrchestratorMetrics(), "m", "code", lambda: "draft")
breakdown = SimpleNamespace(parts=lambda: {"draft_busy": 0.001, "target_busy": 0.006, "wire": 0.001, "idle": 0.0, "overlap": 0.0},
                            predraft="hit")
now = [0.0]
def one_round():
    now[0] += 0.01
    recorder.round(4, 3); recorder.proposer("draft", 4, 3); recorder.round_time(breakdown); recorder.streamed(4, now[0])
print(f"a request's metrics per round (4 drafted, 3 accepted, 4 tokens streamed): {cpu_us(one_round):.1f} us")

async def ready(): return 1
async def waits(n, use_timeout):
    for _ in range(n):
        if use_timeout:
            async with asyncio.timeout(5.0):
                await ready()
        else:
            await asyncio.wait_for(ready(), 5.0)
for use_timeout in (False, True):
    loop.run_until_complete(waits(200, use_timeout))
    t = time.process_time(); loop.run_until_complete(waits(N, use_timeout))
    print(f"{'asyncio.timeout' if use_timeout else 'asyncio.wait_for'} around an await, per await: {(time.process_time() - t) / N * 1e6:.1f} us")
