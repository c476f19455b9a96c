// End-to-end client: drives compactproxy (or, to check this script itself,
// the mock upstream directly) with the official `openai` SDK, the way an
// agent does. e2e_test.go runs it and asserts on its output and on what the
// mock upstream received.
//
// Environment:
//   E2E_BASE_URL  base URL including /v1 (the proxy's, or the mock's)
//   E2E_API_KEY   the key the SDK sends as "Authorization: Bearer ..."
//
// Prints one JSON object on stdout:
//   {"ok": bool, "sdk_version": "...", "scenarios": {name: {...}}, "failures": [...]}
// and exits 1 when any check failed (2 when the script itself broke).
//
// The mock upstream picks its answer from a marker in the last user message
// ("[e2e:plain]", "[e2e:tool]", ...) and answers any request whose last
// message is a role "tool" message with the final text of the tool loop.

import OpenAI from "openai";
import { readFileSync } from "node:fs";

const baseURL = process.env.E2E_BASE_URL;
const apiKey = process.env.E2E_API_KEY;
if (!baseURL || !apiKey) {
	console.error("client.mjs: E2E_BASE_URL and E2E_API_KEY must be set");
	process.exit(2);
}

// The exact texts the mock upstream answers; e2e_test.go uses the same.
const expect = {
	plain: "Hello from the mock upstream.",
	stream: "Hello, streamed world!",
	toolFinal: "It is sunny in Paris, 21 degrees.",
	toolCallID: "call_e2e_weather",
	toolName: "get_weather",
	toolArgs: { city: "Paris" },
	toolResult: '{"city":"Paris","forecast":"sunny","celsius":21}',
	streamToolCallID: "call_e2e_stream_weather",
};

const sdkVersion = JSON.parse(
	readFileSync(new URL("./node_modules/openai/package.json", import.meta.url), "utf8"),
).version;

// maxRetries 0: a failure must show, not be papered over by SDK retries.
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 20_000 });

const model = "e2e-model";
const tools = [
	{
		type: "function",
		function: {
			name: expect.toolName,
			description: "Current weather for a city.",
			parameters: {
				type: "object",
				properties: { city: { type: "string" } },
				required: ["city"],
			},
		},
	},
];

const failures = [];
const scenarios = {};

function check(scenario, cond, what) {
	if (!cond) failures.push(`${scenario}: ${what}`);
	return cond;
}

// headersOf keeps the response headers the test asserts on.
function headersOf(response) {
	const keep = {};
	for (const name of ["x-compactproxy-compaction", "x-request-id", "content-type"]) {
		const v = response.headers.get(name);
		if (v !== null) keep[name] = v;
	}
	return keep;
}

// 1. A plain, non-streaming completion. temperature 0 and a llama.cpp field
// (cache_prompt) ride along: the proxy must forward both as sent.
async function plain() {
	const name = "plain";
	const { data, response } = await client.chat.completions
		.create({
			model,
			temperature: 0,
			cache_prompt: true,
			messages: [
				{ role: "system", content: "You are a terse assistant." },
				{ role: "user", content: "Say hello. [e2e:plain]" },
			],
		})
		.withResponse();
	const content = data.choices?.[0]?.message?.content;
	check(name, content === expect.plain, `content ${JSON.stringify(content)}, want ${JSON.stringify(expect.plain)}`);
	check(name, data.usage?.prompt_tokens > 0, `usage ${JSON.stringify(data.usage)}, want prompt_tokens > 0`);
	scenarios[name] = { content, usage: data.usage ?? null, headers: headersOf(response) };
}

// collectStream reads a chat-completions stream chunk by chunk.
async function collectStream(stream) {
	let content = "";
	let chunks = 0;
	const usageChunks = [];
	let finish = null;
	for await (const chunk of stream) {
		chunks++;
		if (chunk.usage) usageChunks.push({ choices: chunk.choices?.length ?? 0, usage: chunk.usage });
		for (const choice of chunk.choices ?? []) {
			if (choice.delta?.content) content += choice.delta.content;
			if (choice.finish_reason) finish = choice.finish_reason;
		}
	}
	return { content, chunks, usageChunks, finish };
}

// 2. A stream that did not ask for usage: the deltas arrive, and no
// usage-only chunk does (the proxy injects include_usage upstream to read
// the usage, and must hide that chunk from a client that did not ask).
async function stream() {
	const name = "stream";
	const { data: s, response } = await client.chat.completions
		.create({
			model,
			stream: true,
			messages: [{ role: "user", content: "Stream a greeting. [e2e:stream]" }],
		})
		.withResponse();
	const got = await collectStream(s);
	check(name, got.content === expect.stream, `content ${JSON.stringify(got.content)}, want ${JSON.stringify(expect.stream)}`);
	check(name, got.finish === "stop", `finish_reason ${got.finish}, want stop`);
	check(name, got.usageChunks.length === 0, `received ${got.usageChunks.length} usage chunk(s) without asking for usage`);
	check(name, got.chunks >= 3, `only ${got.chunks} chunks: the stream was coalesced`);
	scenarios[name] = { ...got, headers: headersOf(response) };
}

// 2b. A stream that asked for usage gets the usage chunk untouched.
async function streamUsage() {
	const name = "stream_usage";
	const { data: s, response } = await client.chat.completions
		.create({
			model,
			stream: true,
			stream_options: { include_usage: true },
			messages: [{ role: "user", content: "Stream a greeting with usage. [e2e:stream]" }],
		})
		.withResponse();
	const got = await collectStream(s);
	check(name, got.content === expect.stream, `content ${JSON.stringify(got.content)}, want ${JSON.stringify(expect.stream)}`);
	check(name, got.usageChunks.length === 1, `received ${got.usageChunks.length} usage chunks, want 1`);
	const u = got.usageChunks[0];
	check(name, u && u.choices === 0 && u.usage.prompt_tokens > 0, `usage chunk ${JSON.stringify(u)}, want choices [] and prompt_tokens > 0`);
	scenarios[name] = { ...got, headers: headersOf(response) };
}

// 3. A tool-call round trip: the model asks for a tool, the client appends
// the assistant message as received plus a role "tool" answer, and the
// second request gets the final text.
async function toolLoop() {
	const name = "tool";
	const messages = [
		{ role: "system", content: "You can call tools." },
		{ role: "user", content: "What is the weather in Paris? [e2e:tool]" },
	];
	const first = await client.chat.completions.create({ model, messages, tools, tool_choice: "auto" });
	const msg = first.choices?.[0]?.message;
	const call = msg?.tool_calls?.[0];
	check(name, first.choices?.[0]?.finish_reason === "tool_calls", `first finish_reason ${first.choices?.[0]?.finish_reason}, want tool_calls`);
	if (!check(name, call?.id === expect.toolCallID, `tool call ${JSON.stringify(msg)}, want id ${expect.toolCallID}`)) {
		scenarios[name] = { first: msg ?? null };
		return;
	}
	check(name, call.function?.name === expect.toolName, `tool name ${call.function?.name}`);
	let args = null;
	try {
		args = JSON.parse(call.function.arguments);
	} catch {
		// reported below
	}
	check(name, args?.city === expect.toolArgs.city, `tool arguments ${call.function?.arguments}`);

	messages.push(msg); // the assistant message exactly as the SDK returned it
	messages.push({ role: "tool", tool_call_id: call.id, content: expect.toolResult });
	const { data: second, response } = await client.chat.completions
		.create({ model, messages, tools })
		.withResponse();
	const content = second.choices?.[0]?.message?.content;
	check(name, content === expect.toolFinal, `final content ${JSON.stringify(content)}, want ${JSON.stringify(expect.toolFinal)}`);
	scenarios[name] = { tool_call: call, final: content, headers: headersOf(response) };
}

// 4. The same loop streamed, assembled by the SDK's stream helper (what
// agents built on the SDK use): tool-call deltas must arrive intact.
async function streamToolLoop() {
	const name = "stream_tool";
	const messages = [
		{ role: "system", content: "You can call tools." },
		{ role: "user", content: "Weather in Paris, streamed? [e2e:stream_tool]" },
	];
	const first = await client.chat.completions.stream({ model, messages, tools }).finalChatCompletion();
	const msg = first.choices?.[0]?.message;
	const call = msg?.tool_calls?.[0];
	if (!check(name, call?.id === expect.streamToolCallID, `streamed tool call ${JSON.stringify(msg)}, want id ${expect.streamToolCallID}`)) {
		scenarios[name] = { first: msg ?? null };
		return;
	}
	check(name, call.function?.arguments === JSON.stringify(expect.toolArgs), `assembled arguments ${call.function?.arguments}`);
	messages.push({ role: "assistant", content: msg.content ?? null, tool_calls: msg.tool_calls });
	messages.push({ role: "tool", tool_call_id: call.id, content: expect.toolResult });
	const s = await client.chat.completions.create({ model, messages, tools, stream: true });
	const got = await collectStream(s);
	check(name, got.content === expect.toolFinal, `final content ${JSON.stringify(got.content)}, want ${JSON.stringify(expect.toolFinal)}`);
	check(name, got.usageChunks.length === 0, `received ${got.usageChunks.length} usage chunk(s) without asking for usage`);
	scenarios[name] = { tool_call: call, final: got.content };
}

for (const [name, fn] of Object.entries({ plain, stream, stream_usage: streamUsage, tool: toolLoop, stream_tool: streamToolLoop })) {
	try {
		await fn();
	} catch (err) {
		failures.push(`${name}: ${err?.constructor?.name ?? "Error"}: ${err?.status ?? ""} ${err?.message ?? err}`);
	}
}

const ok = failures.length === 0;
process.stdout.write(JSON.stringify({ ok, sdk_version: sdkVersion, scenarios, failures }) + "\n");
process.exit(ok ? 0 : 1);
