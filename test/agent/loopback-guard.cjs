// Preloaded into the agent (node --require) by agent_test.go: the agent may
// talk to loopback only. Every TCP connect and DNS lookup to anything else is
// refused and written, one line each, to $AGENT_GUARD_LOG; the test fails on
// any line. The agent's own switches (PI_OFFLINE, telemetry off) should make
// this file a no-op; it is here to prove they do.
"use strict";
const fs = require("node:fs");
const net = require("node:net");
const dns = require("node:dns");

const logPath = process.env.AGENT_GUARD_LOG;

function isLoopback(host) {
	if (host === undefined || host === null || host === "") return true; // net defaults to localhost
	host = String(host).replace(/^\[|\]$/g, "");
	return host === "localhost" || host === "::1" || /^127\./.test(host) || host === "::ffff:127.0.0.1";
}

function refuse(what) {
	if (logPath) fs.appendFileSync(logPath, what + "\n");
	const err = new Error("loopback-guard: refused " + what);
	err.code = "ECONNREFUSED";
	return err;
}

const connect = net.Socket.prototype.connect;
net.Socket.prototype.connect = function (...args) {
	let opts = args[0];
	if (Array.isArray(opts)) opts = opts[0]; // internal normalized form
	let host, path;
	if (opts !== null && typeof opts === "object") {
		host = opts.host;
		path = opts.path;
	} else if (typeof opts === "string" && isNaN(Number(opts))) {
		path = opts; // a unix socket path
	} else if (typeof args[1] === "string") {
		host = args[1];
	}
	const unix = typeof path === "string" && path !== ""; // https sets path: null
	if (!unix && !isLoopback(host)) {
		const err = refuse("connect " + host);
		process.nextTick(() => this.destroy(err));
		return this;
	}
	return connect.apply(this, args);
};

const lookup = dns.lookup;
dns.lookup = function (hostname, ...rest) {
	if (!isLoopback(hostname)) {
		const cb = rest[rest.length - 1];
		const err = refuse("lookup " + hostname);
		if (typeof cb === "function") process.nextTick(() => cb(err));
		return {};
	}
	return lookup.call(this, hostname, ...rest);
};
const plookup = dns.promises.lookup;
dns.promises.lookup = function (hostname, ...rest) {
	if (!isLoopback(hostname)) return Promise.reject(refuse("lookup " + hostname));
	return plookup.call(this, hostname, ...rest);
};
