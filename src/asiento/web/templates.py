"""The pages, as Jinja2 templates kept in Python strings: no files to ship, no build step."""

from __future__ import annotations

from typing import Any

import jinja2

STYLE = """
:root { --fg:#1d2125; --muted:#5f6b76; --line:#d9dee3; --bg:#f6f7f9; --card:#fff;
  --ok:#1a7f37; --warn:#9a6700; --bad:#cf222e; --run:#0969da; --park:#8250df;
  --ready:#bc4c00; --queued:#57606a; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif;
  color:var(--fg); background:var(--bg); }
header { display:flex; align-items:center; gap:1rem; padding:.6rem 1.4rem;
  background:#24292f; color:#fff; }
header a { color:#fff; text-decoration:none; }
header .brand { font-weight:700; font-size:1.05rem; }
header .store { color:#c9d1d9; font-family:ui-monospace, monospace; font-size:.85rem; }
header .who { margin-left:auto; display:flex; gap:.6rem; align-items:center; }
header form { margin:0; }
header button { background:none; border:1px solid #8b949e; color:#fff; border-radius:4px;
  padding:.15rem .5rem; cursor:pointer; }
main { padding:1rem 1.4rem 3rem; max-width:1200px; }
h1 { font-size:1.35rem; margin:.4rem 0 .8rem; overflow-wrap:anywhere; }
h2 { font-size:1.05rem; margin:1.4rem 0 .5rem; }
a { color:var(--run); }
table { border-collapse:collapse; width:100%; background:var(--card);
  border:1px solid var(--line); }
th, td { text-align:left; padding:.35rem .55rem; border-bottom:1px solid var(--line);
  vertical-align:top; overflow-wrap:anywhere; }
td.at { white-space:nowrap; }
table.timeline th, table.effects th, table.timeline td:nth-child(-n+3),
table.effects td:first-child { overflow-wrap:normal; }
th { background:#eef1f4; font-weight:600; font-size:.85rem; }
td.num { text-align:right; font-variant-numeric:tabular-nums; }
tr.first td { border-top:2px solid var(--line); }
code, pre, .mono { font-family:ui-monospace, SFMono-Regular, Menlo, monospace; font-size:.85rem; }
pre { margin:0; white-space:pre-wrap; word-break:break-all; }
.badge { display:inline-block; padding:.05rem .5rem; border-radius:1rem; font-size:.8rem;
  overflow-wrap:normal; text-align:center;
  font-weight:600; color:#fff; }
.running { background:var(--run); } .suspended { background:var(--warn); }
.uncertain { background:var(--bad); } .closed { background:var(--ok); }
.parked { background:var(--park); } .ready-to-resume { background:var(--ready); }
.waiting-for-a-worker { background:var(--queued); }
.filters a { margin-right:.7rem; }
.filters a.on { font-weight:700; color:var(--fg); text-decoration:none; }
.banner { padding:.6rem .9rem; border-radius:6px; margin:.6rem 0 1rem; border:1px solid; }
.banner.ok { background:#dafbe1; border-color:#4ac26b; }
.banner.error { background:#ffebe9; border-color:#ff8182; }
.banner.info { background:#ddf4ff; border-color:#54aeff; }
.cards { display:grid; grid-template-columns:repeat(auto-fill, minmax(min(360px, 100%), 1fr));
  gap:.8rem; align-items:start; }
.card { background:var(--card); border:1px solid var(--line); border-left:4px solid var(--warn);
  border-radius:6px; padding:.7rem .9rem; min-width:0; }
.card.resolution { border-left-color:var(--bad); }
.card h3 { margin:0 0 .4rem; font-size:.95rem; overflow-wrap:anywhere; }
.card dl { display:grid; grid-template-columns:max-content minmax(0, 1fr); gap:.2rem .7rem;
  margin:.3rem 0; }
.card dt { color:var(--muted); }
.card dd { margin:0; min-width:0; overflow-wrap:anywhere; }
.card input[type=text] { width:100%; padding:.3rem; margin:.2rem 0 .4rem;
  border:1px solid var(--line); border-radius:4px; }
.actions { display:flex; gap:.5rem; }
.actions button { padding:.35rem .9rem; border-radius:5px; border:1px solid; cursor:pointer;
  font-weight:600; }
button.approve { background:var(--ok); color:#fff; border-color:var(--ok); }
button.deny { background:#fff; color:var(--bad); border-color:var(--bad); }
button.happened { background:var(--run); color:#fff; border-color:var(--run); }
button.not-happened { background:#fff; color:var(--fg); border-color:var(--muted); }
.muted { color:var(--muted); }
.facts { display:grid; grid-template-columns:max-content 1fr; gap:.15rem 1rem; }
.facts dt { color:var(--muted); }
.facts dd { margin:0; }
form.login { background:var(--card); border:1px solid var(--line); border-radius:6px;
  padding:1rem; max-width:380px; }
form.login label { display:block; margin:.4rem 0 .2rem; }
form.login input { width:100%; padding:.4rem; border:1px solid var(--line); border-radius:4px; }
form.login button { margin-top:.8rem; padding:.4rem 1rem; }
details summary { cursor:pointer; color:var(--muted); }
"""

BASE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{% block title %}asiento{% endblock %} · asiento</title>
<style>{{ style|safe }}</style></head>
<body>
<header>
  <a class="brand" href="/">asiento</a>
  <span class="store">{{ store }}</span>
  <span class="who">{% block who %}
  {% if operator %}
    <span>signed in as <b>{{ operator.by }}</b></span>
    <form method="post" action="/logout"><input type="hidden" name="csrf" value="{{ csrf }}">
    <button type="submit">log out</button></form>
  {% else %}
    <a href="/login?next={{ here|urlencode }}">log in{% if open_reading %} to decide{% endif %}</a>
  {% endif %}
  {% endblock %}</span>
</header>
<main>
{% if message %}<div class="banner {{ message_kind }}" role="status">{{ message }}</div>{% endif %}
{% block main %}{% endblock %}
</main></body></html>
"""

CARD = """{% macro card(w, csrf, operator) %}
<div class="card {{ w.kind }}" id="wait-{{ w.run_id }}-{{ w.step_id }}">
  <h3>{% if w.kind == 'approval' %}Approve or deny{% else %}Uncertain effect{% endif %}:
    <a href="{{ w.run_id|runurl }}">{{ w.run_id }}</a> · <code>{{ w.step_id }}</code></h3>
  <dl>
    {% if w.is_interrupt %}
    <dt>asked by</dt><dd>the graph's <code>interrupt()</code>: it resumes with the decision
      (approved or not, by whom, the reason)</dd>
    <dt>value</dt><dd><pre class="args">{{ w.args["value"]|pretty }}</pre></dd>
    {% else %}
    <dt>tool</dt><dd><code>{{ w.tool }}</code></dd>
    <dt>arguments</dt><dd><pre class="args">{{ w.args|pretty }}</pre></dd>
    {% endif %}
    {% if w.prepared is not none %}<dt>prepared</dt><dd><pre>{{ w.prepared|pretty }}</pre></dd>
    {% endif %}
    {% if w.idem_key %}<dt>idem_key</dt><dd class="mono">{{ w.idem_key }}</dd>{% endif %}
    {% if w.kind == 'resolution' %}<dt>attempts</dt><dd>{{ w.attempts }}</dd>
    <dt>submitted</dt><dd>{{ w.since|when }}</dd>{% endif %}
    <dt>fingerprint</dt><dd class="mono">{{ w.fingerprint }}</dd>
  </dl>
  {% if operator %}
  <form method="post">
    <input type="hidden" name="run_id" value="{{ w.run_id }}">
    <input type="hidden" name="step_id" value="{{ w.step_id }}">
    <input type="hidden" name="fp" value="{{ w.fingerprint }}">
    <input type="hidden" name="csrf" value="{{ csrf }}">
    {% if w.kind == 'approval' %}
    <input type="text" name="reason" placeholder="reason (required to deny; the model is told)"
      aria-label="reason">
    <div class="actions">
      <button class="approve" formaction="/approve">Approve</button>
      <button class="deny" formaction="/deny">Deny</button>
    </div>
    {% else %}
    <input type="text" name="remote_id" placeholder="remote id, if it happened"
      aria-label="remote id">
    <input type="text" name="reason" placeholder="how you know" aria-label="reason">
    <div class="actions">
      <button class="happened" formaction="/resolve" name="happened" value="yes">It happened
      </button>
      <button class="not-happened" formaction="/resolve" name="happened" value="no">It did not
        happen</button>
    </div>
    {% endif %}
  </form>
  {% else %}
  <p class="muted login-to-decide"><a href="/login?next={{ (w.run_id|runurl)|urlencode }}">Log
    in</a> with the operator token to {% if w.kind == 'approval' %}approve or deny{% else %}say
    whether it happened{% endif %}.</p>
  {% endif %}
</div>
{% endmacro %}"""

RUNS = """{% extends "base.html" %}{% from "card.html" import card %}
{% block title %}runs{% endblock %}
{% block main %}
<h1>Runs</h1>
<p class="filters">
  <a href="/" class="{{ 'on' if not status }}">all ({{ counts.values()|sum }})</a>
  {% for s in statuses %}<a href="/?status={{ s }}" class="{{ 'on' if status == s }}">{{ s }}
  ({{ counts.get(s, 0) }})</a>{% endfor %}
</p>
<h2>Waiting for a person ({{ waiting|length }})</h2>
{% if waiting %}<div class="cards">{% for w in waiting %}{{ card(w, csrf, operator) }}
{% endfor %}</div>
{% else %}<p class="muted">Nothing waits for a person.</p>{% endif %}
<h2>{{ status or "All" }} runs</h2>
<table class="runs">
<thead><tr><th>run</th><th>state</th><th>steps</th><th>last activity</th><th>lease</th>
<th>calls</th><th>tokens in/out</th><th>cost</th><th>spent/budget</th><th>replayed</th>
<th>saved in/out</th><th>saved cost</th></tr></thead>
<tbody>
{% for r in runs %}{% set st = r|state %}<tr>
  <td><a href="{{ r.run_id|runurl }}">{{ r.run_id }}</a></td>
  <td><span class="badge {{ st.css }}">{{ st.name }}</span></td>
  <td class="num">{{ r.steps }}</td><td class="at">{{ r.updated_at|when }}</td>
  <td class="mono">{{ r|lease }}</td>
  <td class="num">{{ r.model_calls }}</td>
  <td class="num">{{ r.input_tokens }}/{{ r.output_tokens }}</td>
  <td class="num">{{ r.cost|money }}</td>
  <td class="num budget">{{ r|budget }}</td>
  <td class="num">{{ r.replayed_calls }}</td>
  <td class="num">{{ r.saved_input_tokens }}/{{ r.saved_output_tokens }}</td>
  <td class="num">{{ r.saved_cost|money }}</td>
</tr>{% else %}<tr><td colspan="12" class="muted">No runs.</td></tr>{% endfor %}
</tbody></table>
{% endblock %}"""

RUN = """{% extends "base.html" %}{% from "card.html" import card %}
{% block title %}{{ run.run_id }}{% endblock %}
{% block main %}{% set st = run|state %}
{% set people = waiting|selectattr("needs_person")|list %}
<h1>Run <code>{{ run.run_id }}</code>
  <span class="badge {{ st.css }}">{{ st.name }}</span></h1>
<dl class="facts">
  <dt>state</dt><dd class="state">{{ st.name }}{% if st.name != run.status.value %} (status
    {{ run.status.value }}){% endif %}: {{ st.meaning }}.{% if not people %}
    Next: {{ st.next }}.{% endif %}</dd>
  <dt>steps</dt><dd>{{ run.steps }} ({{ run.model_calls }} model, {{ run.tool_steps }} tool)</dd>
  <dt>records</dt><dd>{{ run.events }}</dd>
  <dt>started</dt><dd>{{ run.created_at|when }}</dd>
  <dt>last activity</dt><dd>{{ run.updated_at|when }}</dd>
  <dt>lease</dt><dd class="mono">{{ (run|lease) or "free" }} · fence {{ run.fence }}</dd>
  <dt>model calls</dt><dd>{{ run.model_calls }} ({{ run.input_tokens }} tokens in,
    {{ run.output_tokens }} out{% if run.cost %}, cost {{ run.cost|money }}{% endif %})</dd>
  <dt>saved by replay</dt><dd>{{ run.replayed_calls }} calls ({{ run.saved_input_tokens }}
    tokens in, {{ run.saved_output_tokens }} out{% if run.saved_cost %},
    {{ run.saved_cost|money }}{% endif %})</dd>
  {% if run.task is not none %}<dt>task</dt><dd>{{ run.task }} (agent {{ run.agent }},
    claimed {{ run.attempts }}×)</dd>{% endif %}
  {% if run.reason %}<dt>note</dt><dd>{{ run.reason }}</dd>{% endif %}
  {% if in_flight %}<dt>in flight</dt><dd>{{ in_flight }}: its effect left and no outcome
    came back</dd>{% endif %}
</dl>
{% if budget_stop %}{% set stop = budget_stop[1] %}<h2>Stopped on its budget</h2>
<div class="card budget"><p>Stopped before <code>{{ stop.before }}</code>: {{ stop.limit }}
  spent {{ stop.spent.get(stop.limit) }} of {{ stop.budget.get(stop.limit) }}
  (spent: {% for k, v in stop.spent.items() %}{{ k }} {{ v }}{{ ", " if not loop.last }}
  {% endfor %}; budget: {% for k, v in stop.budget.items() %}{{ k }} {{ v }}
  {{ ", " if not loop.last }}{% endfor %}).</p>
  {% if operator %}<form method="post" action="/budget">
    <input type="hidden" name="run_id" value="{{ run.run_id }}">
    <input type="hidden" name="csrf" value="{{ csrf }}">
    <input type="text" name="max_cost" placeholder="new max_cost" aria-label="max_cost">
    <input type="text" name="max_tokens" placeholder="new max_tokens" aria-label="max_tokens">
    <input type="text" name="max_model_calls" placeholder="new max_model_calls"
      aria-label="max_model_calls">
    <input type="text" name="reason" placeholder="why" aria-label="reason">
    <div class="actions"><button class="approve">Raise the budget</button></div>
  </form>{% else %}<p class="muted">Log in with the operator token to raise the budget.</p>
  {% endif %}</div>{% endif %}
{% if people %}<h2>Waiting for a person</h2>
<div class="cards">{% for w in people %}{{ card(w, csrf, operator) }}{% endfor %}</div>{% endif %}
{% for w in waiting if not w.needs_person %}
<div class="banner info">In flight: <code>{{ w.step_id }}</code> {{ w.tool }} was submitted
  at {{ w.since|when }} and has no outcome yet.</div>{% endfor %}
<h2>Timeline</h2>
<table class="timeline">
<thead><tr><th>step</th><th>phase</th><th>decision</th><th>at</th><th>what</th></tr></thead>
<tbody>
{% for step_id, events in timeline %}{% for e in events %}
<tr class="{{ 'first' if loop.first }}" data-step="{{ step_id }}" data-phase="{{ e.phase.value }}">
  <td>{% if loop.first %}<code>{{ step_id }}</code>{% endif %}</td>
  <td>{{ e.phase.value }}</td><td>{{ e.decision.value if e.decision else "" }}</td>
  <td class="at">{{ (e.created_at|when)[11:] }}</td>
  <td>{{ e|summary }}<details><summary>record</summary><pre>{{ e.payload|pretty }}</pre>
  </details></td>
</tr>{% endfor %}{% else %}
<tr><td colspan="5" class="muted">No records yet: the run is queued for a worker.</td></tr>
{% endfor %}
</tbody></table>
{% if effects %}<h2>Effects</h2>
<table class="effects"><thead><tr><th>step</th><th>idem_key</th><th>status</th><th>remote_id</th>
<th>attempts</th><th>updated</th></tr></thead><tbody>
{% for r in effects %}<tr><td><code>{{ r.step_id }}</code></td>
<td class="mono">{{ r.idem_key }}</td>
<td>{{ r.status }}</td><td class="mono">{{ r.remote_id or "" }}</td>
<td class="num">{{ r.attempts }}</td><td class="at">{{ r.updated_at|when }}</td></tr>
{% endfor %}
</tbody></table>{% endif %}
{% endblock %}"""

LOGIN = """{% extends "base.html" %}
{% block title %}log in{% endblock %}
{% block who %}{% endblock %}
{% block main %}
<h1>{% if open_reading %}Log in to decide{% else %}Log in{% endif %}</h1>
<p class="muted">{% if open_reading %}Approving, denying and resolving need{% else %}Reading
the runs and deciding need{% endif %} the operator token, printed by <code>asiento serve</code>
at start (or set in <code>$ASIENTO_WEB_TOKEN</code>). Your name is recorded with every
decision.</p>
<form class="login" method="post" action="/login">
  <input type="hidden" name="next" value="{{ next }}">
  <label for="by">Your name</label><input id="by" name="by" required maxlength="100"
    autocomplete="username">
  <label for="token">Token</label><input id="token" name="token" type="password" required
    autocomplete="current-password">
  <button type="submit">Log in</button>
</form>
{% endblock %}"""

PROBLEM = """{% extends "base.html" %}
{% block title %}{{ heading }}{% endblock %}
{% block main %}<h1>{{ heading }}</h1>
<p>{% if not operator %}<a href="/login?next={{ back|urlencode }}">Log in</a> · {% endif %}
<a href="{{ back }}">Back</a> · <a href="/">All runs</a></p>{% endblock %}"""

TEMPLATES = {
    "base.html": BASE,
    "card.html": CARD,
    "runs.html": RUNS,
    "run.html": RUN,
    "login.html": LOGIN,
    "problem.html": PROBLEM,
}


def environment(filters: dict[str, Any]) -> jinja2.Environment:
    """The templates, HTML-escaped by default, with the page's filters."""
    env = jinja2.Environment(
        loader=jinja2.DictLoader(TEMPLATES),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(filters)
    env.globals["style"] = STYLE
    return env
