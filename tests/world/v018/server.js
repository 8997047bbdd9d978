"use strict";
// Colyseus 0.18 reference world for npc-bridge tests: see ../README.md and ../common/world.js.

// 0.18 declares Node >= 22; on Node 20 its reconnection path needs a global WebSocket before it loads.
if (typeof globalThis.WebSocket === "undefined") {
  globalThis.WebSocket = require("ws");
}
const core = require("@colyseus/core");
const { WebSocketTransport } = require("@colyseus/ws-transport");
const { schema, t } = require("@colyseus/schema");
const express = require("express");
const { main } = require("../common/world.js");

// Schema 5 needs the t.* field builders.
const State = schema({ note: t.string().default(""), blob: t.string().default("") }, "WorldState");

main({ version: "0.18", core, WebSocketTransport, express, State }).catch((err) => {
  console.error(err);
  process.exit(1);
});
