"use strict";
// Colyseus 0.16 reference world for npc-bridge tests: see ../README.md and ../common/world.js.
const core = require("@colyseus/core");
const { WebSocketTransport } = require("@colyseus/ws-transport");
const { schema } = require("@colyseus/schema");
const express = require("express");
const { main } = require("../common/world.js");

// Schema 3 takes plain type names.
const State = schema({ note: "string", blob: "string" }, "WorldState");

main({ version: "0.16", core, WebSocketTransport, express, State }).catch((err) => {
  console.error(err);
  process.exit(1);
});
