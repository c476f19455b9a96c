# Generator of compactproxy.test.yaml beside it (not run by make test; rerun
# after editing a runbook text or a case, then review the diff):
#   python3 deploy/prometheus/tests/gen_tests.py > deploy/prometheus/tests/compactproxy.test.yaml
# The cases and the expected summaries (values included) are written here by
# hand; only the runbook texts are copied from the rules file, so they are not
# typed twice.
import os, sys, yaml
here = os.path.dirname(os.path.abspath(__file__))
rules = yaml.safe_load(open(os.path.join(here, '..', 'compactproxy.rules.yaml')))
rb = {r['alert']: r['annotations']['runbook'] for g in rules['groups'] for r in g['rules'] if 'alert' in r}
J = 'job="compactproxy"'
def ann(alert, summary): return {'summary': summary, 'runbook': rb[alert]}
def fire(alert, t, labels, summary): return {'eval_time': t, 'alertname': alert, 'exp_alerts': [{'exp_labels': dict(labels, severity=sev[alert]), 'exp_annotations': ann(alert, summary)}]}
def silent(alert, t): return {'eval_time': t, 'alertname': alert, 'exp_alerts': []}
sev = {r['alert']: r['labels']['severity'] for g in rules['groups'] for r in g['rules'] if 'alert' in r}
job = {'job': 'compactproxy'}
def s(name, labels, values):
    lab = ','.join([J] + [f'{k}="{v}"' for k, v in labels.items()])
    return {'series': f'{name}{{{lab}}}', 'values': values}
tests = []
def case(name, series, checks):
    tests.append({'name': name, 'interval': '1m', 'input_series': series, 'alert_rule_test': checks})

A='CompactproxySummarizeFailing'
case(A+': half of the calls fail', [
    s('compactproxy_summarize_total', {'instance': 'a', 'result': 'failure'}, '0+1x60'),
    s('compactproxy_summarize_total', {'instance': 'b', 'result': 'success'}, '0+1x60'),
], [silent(A, '5m'),  # pending: for 10m not yet over
    fire(A, '30m', job, 'compactproxy: 50% of summarize calls fail')])
case(A+': a tenth fail', [
    s('compactproxy_summarize_total', {'instance': 'a', 'result': 'failure'}, '0+1x60'),
    s('compactproxy_summarize_total', {'instance': 'a', 'result': 'success'}, '0+9x60'),
], [silent(A, '30m')])
case(A+': every call fails but only two calls', [
    s('compactproxy_summarize_total', {'instance': 'a', 'result': 'failure'}, '0x10 1 2x50'),
    s('compactproxy_summarize_total', {'instance': 'a', 'result': 'success'}, '0x62'),
], [silent(A, '20m'), silent(A, '25m')])

A='CompactproxyLatchEngagingOften'
case(A+': 12 engagements over two replicas', [
    s('compactproxy_latch_engaged_total', {'instance': 'a'}, '0+1x6 6x80'),
    s('compactproxy_latch_engaged_total', {'instance': 'b'}, '0+1x6 6x80'),
], [fire(A, '30m', job, 'compactproxy: the summarize failure latch engaged 12 times in 1h'),
    silent(A, '80m')])  # the engagements are more than an hour old
case(A+': 9 engagements', [
    s('compactproxy_latch_engaged_total', {'instance': 'a'}, '0+1x9 9x80'),
], [silent(A, '30m')])

A='CompactproxyPairingViolations'
case(A+': one orphan tool result', [
    s('compactproxy_pairing_violations_total', {'instance': 'a', 'kind': 'orphan_tool_result'}, '0x10 1x40'),
    s('compactproxy_pairing_violations_total', {'instance': 'a', 'kind': 'unanswered_tool_call'}, '0x50'),
], [fire(A, '20m', dict(job, kind='orphan_tool_result'), 'compactproxy: 1 tool-call pairing violations (orphan_tool_result) in 15m'),
    silent(A, '40m')])
case(A+': a counter that does not move', [
    s('compactproxy_pairing_violations_total', {'instance': 'a', 'kind': 'orphan_tool_result'}, '5x40'),
], [silent(A, '30m')])

A='CompactproxyCompactionInvariantFailure'
case(A+': one discarded view', [
    s('compactproxy_compaction_invariant_failures_total', {'instance': 'a'}, '0x5 1x60'),
], [fire(A, '20m', job, 'compactproxy: a compacted view broke tool-call pairing'), silent(A, '60m')])
case(A+': none', [
    s('compactproxy_compaction_invariant_failures_total', {'instance': 'a'}, '0x60'),
], [silent(A, '40m')])

A='CompactproxyUpstreamRetriesHigh'
case(A+': a fifth of chat requests retried on 5xx', [
    s('compactproxy_upstream_retries_total', {'instance': 'a', 'op': 'chat', 'reason': 'status_5xx'}, '0+2x40'),
    s('compactproxy_http_requests_total', {'instance': 'a', 'route': 'chat', 'code': '200'}, '0+10x40'),
], [silent(A, '8m'), fire(A, '30m', dict(job, route='chat'), 'compactproxy: 20% of chat requests needed an upstream retry')])
# Claude Code and Codex: their retries count under op=messages/responses and
# are divided by their own route's requests, so a busy healthy chat route
# does not dilute them.
case(A+': Messages retried on 5xx while chat is healthy and busier', [
    s('compactproxy_upstream_retries_total', {'instance': 'a', 'op': 'messages', 'reason': 'status_5xx'}, '0+3x40'),
    s('compactproxy_http_requests_total', {'instance': 'a', 'route': 'messages', 'code': '200'}, '0+10x40'),
    s('compactproxy_upstream_retries_total', {'instance': 'a', 'op': 'chat', 'reason': 'status_5xx'}, '0x40'),
    s('compactproxy_http_requests_total', {'instance': 'a', 'route': 'chat', 'code': '200'}, '0+100x40'),
], [silent(A, '8m'), fire(A, '30m', dict(job, route='messages'), 'compactproxy: 30% of messages requests needed an upstream retry')])
case(A+': Responses retried on 429', [
    s('compactproxy_upstream_retries_total', {'instance': 'a', 'op': 'responses', 'reason': 'status_429'}, '0+2x40'),
    s('compactproxy_http_requests_total', {'instance': 'b', 'route': 'responses', 'code': '200'}, '0+10x40'),
], [fire(A, '30m', dict(job, route='responses'), 'compactproxy: 20% of responses requests needed an upstream retry')])
case(A+': summarize retries, overflow recoveries and a few 5xx retries', [
    s('compactproxy_upstream_retries_total', {'instance': 'a', 'op': 'summarize', 'reason': 'status_5xx'}, '0+50x40'),
    s('compactproxy_upstream_retries_total', {'instance': 'a', 'op': 'chat', 'reason': 'context_overflow'}, '0+50x40'),
    s('compactproxy_upstream_retries_total', {'instance': 'a', 'op': 'chat', 'reason': 'status_429'}, '0+1x40'),
    s('compactproxy_http_requests_total', {'instance': 'a', 'route': 'chat', 'code': '200'}, '0+20x40'),
], [silent(A, '30m')])

A='CompactproxyChat5xx'
case(A+': a tenth of chat requests are 502', [
    s('compactproxy_http_requests_total', {'instance': 'a', 'route': 'chat', 'code': '502'}, '0+1x40'),
    s('compactproxy_http_requests_total', {'instance': 'a', 'route': 'chat', 'code': '200'}, '0+9x40'),
], [silent(A, '3m'), fire(A, '20m', dict(job, route='chat'), 'compactproxy: 10% of chat requests end in 5xx')])
case(A+': a Messages 5xx storm while chat is healthy and busier', [
    s('compactproxy_http_requests_total', {'instance': 'a', 'route': 'messages', 'code': '502'}, '0+5x40'),
    s('compactproxy_http_requests_total', {'instance': 'a', 'route': 'messages', 'code': '200'}, '0+5x40'),
    s('compactproxy_http_requests_total', {'instance': 'a', 'route': 'chat', 'code': '200'}, '0+200x40'),
], [silent(A, '3m'), fire(A, '20m', dict(job, route='messages'), 'compactproxy: 50% of messages requests end in 5xx')])
case(A+': Responses answered 503 on two replicas', [
    s('compactproxy_http_requests_total', {'instance': 'a', 'route': 'responses', 'code': '503'}, '0+1x40'),
    s('compactproxy_http_requests_total', {'instance': 'b', 'route': 'responses', 'code': '503'}, '0+1x40'),
    s('compactproxy_http_requests_total', {'instance': 'b', 'route': 'responses', 'code': '200'}, '0+8x40'),
], [fire(A, '20m', dict(job, route='responses'), 'compactproxy: 20% of responses requests end in 5xx')])
case(A+': 5xx on passthrough only, chat at 1%', [
    s('compactproxy_http_requests_total', {'instance': 'a', 'route': 'passthrough', 'code': '502'}, '0+50x40'),
    s('compactproxy_http_requests_total', {'instance': 'a', 'route': 'chat', 'code': '503'}, '0+1x40'),
    s('compactproxy_http_requests_total', {'instance': 'a', 'route': 'chat', 'code': '200'}, '0+99x40'),
], [silent(A, '20m')])

A='CompactproxyCompactionImpossible'
case(A+': one request', [
    s('compactproxy_compaction_impossible_total', {'instance': 'a'}, '0x5 1x60'),
], [fire(A, '20m', job, 'compactproxy: requests whose system prompt and tools alone exceed the budget'), silent(A, '60m')])
case(A+': none', [
    s('compactproxy_compaction_impossible_total', {'instance': 'a'}, '0x60'),
], [silent(A, '40m')])

A='CompactproxyUnknownWindow'
case(A+': requests keep arriving for an unknown window', [
    s('compactproxy_unknown_window_total', {'instance': 'a'}, '0+1x60'),
], [silent(A, '10m'), fire(A, '40m', job, 'compactproxy: requests for a model with an unknown context window (not compacted)')])
case(A+': none', [
    s('compactproxy_unknown_window_total', {'instance': 'a'}, '0x60'),
], [silent(A, '40m')])

A='CompactproxyStoreErrors'
case(A+': redis loads failing', [
    s('compactproxy_store_errors_total', {'instance': 'a', 'op': 'load'}, '0+3x30'),
    s('compactproxy_store_errors_total', {'instance': 'a', 'op': 'save'}, '0x30'),
], [fire(A, '20m', dict(job, op='load'), 'compactproxy: state store errors (load)')])
case(A+': none', [
    s('compactproxy_store_errors_total', {'instance': 'a', 'op': 'load'}, '0x30'),
], [silent(A, '20m')])

A='CompactproxyStreamAborts'
case(A+': a tenth of streams cut', [
    s('compactproxy_stream_aborts_total', {'instance': 'a'}, '0+1x40'),
    s('compactproxy_http_requests_total', {'instance': 'a', 'route': 'chat', 'code': '200'}, '0+10x40'),
], [fire(A, '30m', job, 'compactproxy: 10% of chat, Responses and Messages requests had their upstream stream cut')])
case(A+': a tenth of Messages requests cut', [
    s('compactproxy_stream_aborts_total', {'instance': 'a'}, '0+1x40'),
    s('compactproxy_http_requests_total', {'instance': 'a', 'route': 'messages', 'code': '200'}, '0+10x40'),
], [fire(A, '30m', job, 'compactproxy: 10% of chat, Responses and Messages requests had their upstream stream cut')])
case(A+': one in a hundred', [
    s('compactproxy_stream_aborts_total', {'instance': 'a'}, '0+1x40'),
    s('compactproxy_http_requests_total', {'instance': 'a', 'route': 'chat', 'code': '200'}, '0+100x40'),
], [silent(A, '30m')])

A='CompactproxyOverheadHigh'
def hist(buckets):
    return [s('compactproxy_overhead_seconds_bucket', {'instance': 'a', 'le': le}, v) for le, v in buckets]
case(A+': most requests take 100-200 ms', hist([('0.05', '0+10x40'), ('0.1', '0+10x40'), ('0.2', '0+100x40'), ('+Inf', '0+100x40')]),
     [silent(A, '15m'), fire(A, '30m', job, 'compactproxy: p99 overhead 198.9ms')])
case(A+': every request under 50 ms', hist([('0.05', '0+100x40'), ('0.1', '0+100x40'), ('0.2', '0+100x40'), ('+Inf', '0+100x40')]),
     [silent(A, '30m')])

tests.append({'name': 'recording rules: tokens saved and cache share', 'interval': '1m',
    'input_series': [
        s('compactproxy_context_tokens_sum', {'instance': 'a'}, '0+6000x20'),
        s('compactproxy_context_tokens_sum', {'instance': 'b'}, '0+6000x20'),
        s('compactproxy_forwarded_tokens_sum', {'instance': 'a'}, '0+1500x20'),
        s('compactproxy_forwarded_tokens_sum', {'instance': 'b'}, '0+1500x20'),
        s('compactproxy_usage_input_tokens_total', {'instance': 'a', 'kind': 'uncached'}, '0+1800x20'),
        s('compactproxy_usage_input_tokens_total', {'instance': 'a', 'kind': 'cache_read'}, '0+1800x20'),
        s('compactproxy_usage_input_tokens_total', {'instance': 'a', 'kind': 'cache_write'}, '0x20'),
    ],
    'promql_expr_test': [
        # (6000-1500) tokens a minute on each of two replicas = 150/s; cache_read is half the input.
        {'expr': 'compactproxy:tokens_saved:rate5m', 'eval_time': '10m', 'exp_samples': [{'labels': 'compactproxy:tokens_saved:rate5m{job="compactproxy"}', 'value': 150}]},
        {'expr': 'compactproxy:usage_cache_read:ratio_rate5m', 'eval_time': '10m', 'exp_samples': [{'labels': 'compactproxy:usage_cache_read:ratio_rate5m{job="compactproxy"}', 'value': 0.5}]},
    ]})

out = {'rule_files': ['../compactproxy.rules.yaml'], 'evaluation_interval': '1m', 'tests': tests}
hdr = '''# Unit tests of every alert in ../compactproxy.rules.yaml: each fires when it
# should and stays silent when it should not (below its threshold, before its
# `for`, after its window). Run: promtool test rules deploy/prometheus/tests/compactproxy.test.yaml
# (test/ops runs it in `make test` and checks every alert has both kinds of case).
'''
sys.stdout.write(hdr + yaml.safe_dump(out, sort_keys=False, width=100, allow_unicode=True))
