// The agent's client for the Responses and Messages loops: the official SDKs
// from npm (`openai`'s client.responses.create, `@anthropic-ai/sdk`'s
// client.messages.create), pinned by test/e2e/package-lock.json and
// installed by scripts/e2e-deps.sh. dialect_test.go starts one per run and
// drives it step by step: it writes one request a line on stdin, this script
// sends it with the SDK (the whole history each time, as agents do; for
// Responses store:false, no previous_response_id) and writes one JSON line
// of what the agent saw on file descriptor 3 (stdout and stderr are the
// process log):
//
//   in:  {"step": 3, "stream": true, "params": {...}, "headers": {...}}
//   out: {"step": 3, "status": 200, "headers": {"x-compactproxy-...": "..."},
//         "usage": {...}, "stream_ok": true, "events": 14, "error": ""}
//
// status is the HTTP status (0 = no answer: a connection error, in "error");
// stream_ok is true for a stream that ended with its final event
// (response.completed, message_stop) and no error event, and for a
// non-stream answer that parsed.
//
// Environment:
//   SDK_DIALECT   responses | messages
//   SDK_BASE_URL  the base URL the SDK is given (compactproxy's, or the
//                 recorder's for a run straight at llama-server)
//   SDK_MODULES   the folder whose node_modules holds the SDKs (test/e2e)
//   SDK_TIMEOUT_MS  the SDK's request timeout (a hang guard, not a budget)

import { createRequire } from "node:module";
import { createInterface } from "node:readline";
import { readFileSync, writeSync } from "node:fs";
import { join } from "node:path";

const dialect = process.env.SDK_DIALECT;
const baseURL = process.env.SDK_BASE_URL;
const modules = process.env.SDK_MODULES;
const timeout = Number(process.env.SDK_TIMEOUT_MS || 600_000);
if (!["responses", "messages"].includes(dialect) || !baseURL || !modules) {
	console.error("sdkclient.mjs: SDK_DIALECT (responses|messages), SDK_BASE_URL and SDK_MODULES must be set");
	process.exit(2);
}

const require = createRequire(join(modules, "package.json"));
const apiKey = "sk-llamatest-not-a-real-key";
// pkgVersion reads the installed version (neither SDK exports package.json).
const pkgVersion = (name) => JSON.parse(readFileSync(join(modules, "node_modules", name, "package.json"), "utf8")).version;
let client, sdkVersion;
if (dialect === "responses") {
	const { OpenAI } = require("openai");
	sdkVersion = "openai " + pkgVersion("openai");
	// maxRetries 0: a failure must show, not be papered over by SDK retries.
	client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout });
} else {
	const Anthropic = require("@anthropic-ai/sdk").default;
	sdkVersion = "@anthropic-ai/sdk " + pkgVersion("@anthropic-ai/sdk");
	// The Anthropic SDK appends /v1/messages to the base URL itself.
	client = new Anthropic({ baseURL: baseURL.replace(/\/v1\/?$/, ""), apiKey, maxRetries: 0, timeout });
}
console.error(`sdkclient.mjs: ${dialect} through ${sdkVersion}`);

function out(obj) {
	writeSync(3, JSON.stringify(obj) + "\n");
}

function pickHeaders(h) {
	const o = {};
	if (!h) return o;
	for (const [k, v] of h.entries()) {
		if (k.startsWith("x-compactproxy-")) o[k] = v;
	}
	return o;
}

async function step(req) {
	const res = { step: req.step, status: 0, headers: {}, usage: null, stream_ok: false, events: 0, error: "" };
	const params = { ...req.params, stream: !!req.stream };
	const opts = { headers: req.headers ?? {} };
	try {
		const api = dialect === "responses" ? client.responses : client.messages;
		const { data, response } = await api.create(params, opts).withResponse();
		res.status = response.status;
		res.headers = pickHeaders(response.headers);
		if (!req.stream) {
			res.usage = data.usage ?? null;
			res.stream_ok = true;
			res.text_len = textLength(data);
			return res;
		}
		let done = false;
		for await (const ev of data) {
			res.events++;
			switch (ev.type) {
				case "response.completed":
					res.usage = ev.response?.usage ?? null;
					done = true;
					break;
				case "response.failed":
				case "response.incomplete":
				case "error":
					res.error = `${ev.type}: ${JSON.stringify(ev).slice(0, 300)}`;
					break;
				case "message_start":
					res.usage = ev.message?.usage ?? null;
					break;
				case "message_delta":
					if (ev.usage) res.usage = { ...(res.usage ?? {}), ...ev.usage };
					break;
				case "message_stop":
					done = true;
					break;
			}
		}
		res.stream_ok = done && res.error === "";
		if (!done && res.error === "") res.error = "the stream ended without its final event";
	} catch (err) {
		if (typeof err?.status === "number") {
			res.status = err.status;
			res.headers = pickHeaders(err.headers);
			res.error = JSON.stringify(err.error ?? err.message).slice(0, 600);
		} else {
			res.error = `${err?.name ?? "Error"}: ${err?.message ?? err}`.slice(0, 600);
		}
	}
	return res;
}

function textLength(data) {
	let n = 0;
	for (const item of data.output ?? data.content ?? []) {
		if (typeof item.text === "string") n += item.text.length;
		for (const c of item.content ?? []) if (typeof c.text === "string") n += c.text.length;
	}
	return n;
}

// One request at a time, in order: the next line is read only after the
// answer to this one was written (the Go side waits for it anyway).
const rl = createInterface({ input: process.stdin, crlfDelay: Infinity });
for await (const line of rl) {
	if (!line.trim()) continue;
	let req;
	try {
		req = JSON.parse(line);
	} catch (e) {
		out({ step: -1, status: 0, error: "sdkclient.mjs: bad input line: " + e.message });
		continue;
	}
	out(await step(req));
}
