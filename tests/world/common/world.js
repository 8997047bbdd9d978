"use strict";
/**
 * Reference world room for npc-bridge tests (world-protocol.md), shared by the 0.16 and 0.18 servers.
 *
 * The version folders (../v016, ../v018) load their own Colyseus packages and pass them in, because
 * this file sits outside both node_modules trees.
 *
 * Environment: PORT (required), WORLD_TOKEN (the worker token; never on the command line),
 * RECONNECT_SECONDS (allowReconnection window, default 20), SAY_PARTS ("1": offer the say-parts
 * feature in worker:claimed), EXTRA_NPCS (comma-separated NPC ids granted besides the four known ones).
 */

const http = require("http");

const KNOWN_NPCS = new Set(["cafe-minori", "cinema-aoi", "ryokan-fumi", "haruno"]);
const SAY_PARTS_FEATURE = "say-parts";

function createWorld({ version, core, WebSocketTransport, express, State }) {
  const token = process.env.WORLD_TOKEN || "";
  const reconnectSeconds = Number(process.env.RECONNECT_SECONDS || "20");
  const knownNpcs = new Set(KNOWN_NPCS);
  for (const npcId of (process.env.EXTRA_NPCS || "").split(",")) {
    if (npcId) {
      knownNpcs.add(npcId);
    }
  }
  // Whether worker:claimed answers offer say-parts; POST /debug/features changes it at run time.
  let offerSayParts = process.env.SAY_PARTS === "1";

  // Everything the tests read back. Kept per process: a restart starts a new record.
  // Epoch milliseconds with sub-millisecond resolution, for the benchmark's latency figures.
  const nowHr = () => performance.timeOrigin + performance.now();
  const record = {
    version,
    talks: [],        // {id, npcId, atHr}: each npc:talk as it was sent to the workers
    said: [],
    typed: [],
    claims: [],
    claimed: [],      // {sessionId, npcIds, denied, features, at}: each worker:claimed answer sent
    parts: [],        // {sessionId, payload, at, atHr}: each npc:say:part received
    violations: [],   // {rule, replyTo, sessionId, detail, at}: say-parts rules the bridge broke
    joins: [],        // {sessionId, worker, at}
    leaves: [],       // {sessionId, worker, consented, code, at}
    drops: [],        // {sessionId, code, at}: non-consented, reconnection allowed
    reconnects: [],   // {sessionId, at}
    authFailures: 0,
    authFailuresAt: [],
  };
  const rooms = new Set();

  function checkWorker(options) {
    if (!options || options.worker !== true) {
      return { player: true };
    }
    if (typeof options.token === "string" && options.token === token && token !== "") {
      return { worker: true, client: String(options.client || "") };
    }
    record.authFailures += 1;
    record.authFailuresAt.push(Date.now());
    return false;
  }

  class WorldRoom extends core.Room {
    onCreate() {
      rooms.add(this);
      this.autoDispose = false;
      this.setState(new State());
      this.workers = new Map();  // sessionId -> client
      this.granted = new Map();  // npcId -> sessionId
      this.partsOffered = new Map();  // sessionId -> whether its latest worker:claimed offered say-parts
      this.partsByReply = new Map();  // replyTo -> [part payloads] received so far
      this.saidReplies = new Set();   // replyTo of every npc:say received

      this.onMessage("worker:claim", (client, payload) => {
        if (!this.workers.has(client.sessionId)) {
          return;
        }
        const ids = Array.isArray(payload && payload.npcIds) ? payload.npcIds : [];
        const granted = [];
        const denied = [];
        for (const npcId of ids) {
          if (typeof npcId !== "string" || !knownNpcs.has(npcId)) {
            denied.push({ npcId: String(npcId), reason: "unknown npc" });
            continue;
          }
          const holder = this.granted.get(npcId);
          if (holder !== undefined && holder !== client.sessionId && this.workers.has(holder)) {
            denied.push({ npcId, reason: "claimed by another worker" });
            continue;
          }
          this.granted.set(npcId, client.sessionId);
          granted.push(npcId);
        }
        record.claims.push({ sessionId: client.sessionId, npcIds: ids, scope: payload && payload.scope, at: Date.now() });
        const answer = { npcIds: granted, denied };
        if (offerSayParts) {
          answer.features = [SAY_PARTS_FEATURE];
        }
        this.partsOffered.set(client.sessionId, offerSayParts);
        record.claimed.push(Object.assign({ sessionId: client.sessionId, features: [], at: Date.now() }, answer));
        client.send("worker:claimed", answer);
      });

      this.onMessage("npc:say", (client, payload) => {
        record.said.push({ sessionId: client.sessionId, payload, at: Date.now(), atHr: nowHr() });
        this.checkSay(client, payload || {});
      });

      this.onMessage("npc:say:part", (client, payload) => {
        record.parts.push({ sessionId: client.sessionId, payload, at: Date.now(), atHr: nowHr() });
        this.checkPart(client, payload || {});
      });

      this.onMessage("npc:typing", (client, payload) => {
        record.typed.push({ sessionId: client.sessionId, payload, at: Date.now() });
      });
    }

    onAuth(client, options) {
      return checkWorker(options);
    }

    violation(rule, client, replyTo, detail) {
      record.violations.push({ rule, replyTo, sessionId: client.sessionId, detail, at: Date.now() });
    }

    // world-protocol.md, "Speaking sentence by sentence": parts only when offered, index 0, 1, … in
    // order, never after the final npc:say of the same reply.
    checkPart(client, payload) {
      const replyTo = payload.replyTo;
      if (!this.partsOffered.get(client.sessionId)) {
        this.violation("part_not_offered", client, replyTo, "say-parts was not offered on this connection");
      }
      if (this.saidReplies.has(replyTo)) {
        this.violation("part_after_say", client, replyTo, `part ${payload.index} after the final npc:say`);
      }
      const parts = this.partsByReply.get(replyTo) || [];
      if (payload.index !== parts.length) {
        this.violation("part_out_of_order", client, replyTo, `index ${payload.index}, expected ${parts.length}`);
      }
      if (typeof payload.text !== "string" || payload.text === "") {
        this.violation("part_empty", client, replyTo, "a part needs a non-empty text");
      }
      parts.push(payload);
      this.partsByReply.set(replyTo, parts);
    }

    // The final line is exactly the parts joined, with part 0's emotion (when parts were sent).
    checkSay(client, payload) {
      const replyTo = payload.replyTo;
      this.saidReplies.add(replyTo);
      const parts = this.partsByReply.get(replyTo);
      if (!parts || parts.length === 0) {
        return;
      }
      const joined = parts.map((p) => p.text).join("");
      if (payload.text !== joined) {
        this.violation("say_differs_from_parts", client, replyTo, `say ${JSON.stringify(payload.text)} != parts ${JSON.stringify(joined)}`);
      }
      if (payload.emotion !== parts[0].emotion) {
        this.violation("say_emotion_differs", client, replyTo, `say ${payload.emotion} != part 0 ${parts[0].emotion}`);
      }
    }

    onJoin(client, options) {
      const worker = Boolean(options && options.worker);
      if (worker) {
        this.workers.set(client.sessionId, client);
      }
      record.joins.push({ sessionId: client.sessionId, worker, at: Date.now() });
    }

    // 0.18 calls onDrop for a non-consented close (when defined) and onLeave otherwise.
    onDrop(client, code) {
      record.drops.push({ sessionId: client.sessionId, code, at: Date.now() });
      this.allowReconnection(client, reconnectSeconds);
    }

    onReconnect(client) {
      if (this.workers.has(client.sessionId)) {
        this.workers.set(client.sessionId, client);
      }
      record.reconnects.push({ sessionId: client.sessionId, at: Date.now() });
    }

    async onLeave(client, consentedOrCode) {
      const consented = version === "0.16" ? consentedOrCode === true : consentedOrCode === 4000;
      const code = version === "0.16" ? undefined : consentedOrCode;
      if (version === "0.16" && !consented && !client.__dropped) {
        // 0.16 has no onDrop: hold the seat here and record the drop.
        client.__dropped = true;
        record.drops.push({ sessionId: client.sessionId, code, at: Date.now() });
        try {
          const again = await this.allowReconnection(client, reconnectSeconds);
          record.reconnects.push({ sessionId: again.sessionId, at: Date.now() });
          this.workers.set(again.sessionId, again);
          return;
        } catch (e) {
          // reconnection window expired: a real leave
        }
      }
      const worker = this.workers.has(client.sessionId);
      this.workers.delete(client.sessionId);
      record.leaves.push({ sessionId: client.sessionId, worker, consented, code, at: Date.now() });
    }

    workerClients() {
      return [...this.workers.values()];
    }
  }

  // The static variant refuses a bad token at matchmaking already (HTTP 525 / 200 + 4215).
  class StaticAuthWorldRoom extends WorldRoom {
    static async onAuth(_token, options) {
      return checkWorker(options);
    }
  }
  // An instance onAuth next to a static one is ignored by Colyseus (with a log line): remove it.
  StaticAuthWorldRoom.prototype.onAuth = core.Room.prototype.onAuth;

  function workerClients() {
    return [...rooms].flatMap((room) => room.workerClients());
  }

  function toWorkers(fn) {
    const clients = workerClients();
    clients.forEach(fn);
    return clients.length;
  }

  function installDebugRoutes(app) {
    const json = express.json({ limit: "64mb" });
    const ok = (res, body) => res.json(Object.assign({ ok: true }, body || {}));

    app.get("/debug/health", (req, res) => ok(res, { version, pid: process.pid }));
    // Offer say-parts (or stop offering it) in the worker:claimed answers from now on.
    app.post("/debug/features", json, (req, res) => {
      offerSayParts = Boolean((req.body || {}).sayParts);
      ok(res, { sayParts: offerSayParts });
    });
    app.get("/debug/record", (req, res) => {
      const workers = workerClients().map((c) => c.sessionId);
      const roomIds = [...rooms].map((room) => room.roomId);
      res.json(Object.assign({ workers, roomIds, sayParts: offerSayParts }, record));
    });
    app.post("/debug/talk", json, (req, res) => {
      const b = req.body || {};
      const payload = {
        id: b.id || `evt-${Date.now()}-${Math.floor(Math.random() * 1e6)}`,
        npcId: b.npcId,
        playerId: b.playerId,
        playerName: b.playerName || "旅人1",
        text: b.text,
        at: b.at === undefined ? Date.now() : b.at,
      };
      const sentAtHr = nowHr();
      const sent = toWorkers((c) => c.send("npc:talk", payload));
      record.talks.push({ id: payload.id, npcId: payload.npcId, atHr: sentAtHr });
      ok(res, { sent, id: payload.id });
    });
    app.post("/debug/event", json, (req, res) => {
      const b = req.body || {};
      const payload = {
        npcId: b.npcId,
        playerId: b.playerId === undefined ? null : b.playerId,
        kind: b.kind || "greet",
        text: b.text || "",
        at: b.at === undefined ? Date.now() : b.at,
      };
      ok(res, { sent: toWorkers((c) => c.send("npc:event", payload)) });
    });
    app.post("/debug/left", json, (req, res) => {
      const b = req.body || {};
      const payload = { playerId: b.playerId, at: b.at === undefined ? Date.now() : b.at };
      ok(res, { sent: toWorkers((c) => c.send("player:left", payload)) });
    });
    // Any type and payload, as Colyseus encodes them (malformed payloads, unknown types, big texts).
    app.post("/debug/send", json, (req, res) => {
      const b = req.body || {};
      ok(res, { sent: toWorkers((c) => c.send(b.type, b.payload)) });
    });
    // Raw bytes (hex) straight onto the worker sockets: broken frames.
    app.post("/debug/raw", json, (req, res) => {
      const bytes = Buffer.from(String((req.body || {}).hex || ""), "hex");
      ok(res, { sent: toWorkers((c) => c.raw(bytes)) });
    });
    // A big room state: every client receives it as a state patch.
    app.post("/debug/state", json, (req, res) => {
      const size = Number((req.body || {}).bytes || 0);
      rooms.forEach((room) => { room.state.blob = "x".repeat(size); });
      ok(res, { size });
    });
    // Cut the worker sockets without a close frame: a drop the room may allow reconnection for.
    app.post("/debug/drop", json, (req, res) => {
      ok(res, { sent: toWorkers((c) => c.ref.terminate()) });
    });
  }

  return { WorldRoom, StaticAuthWorldRoom, installDebugRoutes, record };
}

async function main(modules) {
  const { version, core, WebSocketTransport, express } = modules;
  const port = Number(process.env.PORT);
  if (!port) {
    throw new Error("PORT is required");
  }
  const world = createWorld(modules);

  let server;
  if (version === "0.16") {
    const app = express();
    world.installDebugRoutes(app);
    const httpServer = http.createServer(app);
    server = new core.Server({ transport: new WebSocketTransport({ server: httpServer }), greet: false });
  } else {
    server = new core.Server({
      transport: new WebSocketTransport(),
      express: (app) => world.installDebugRoutes(app),
      greet: false,
    });
  }
  server.define("world", world.WorldRoom);
  server.define("world_static", world.StaticAuthWorldRoom);
  await server.listen(port, "127.0.0.1");
  // Create the room up front so debug injections work before the first join.
  await core.matchMaker.createRoom("world", {});
  await core.matchMaker.createRoom("world_static", {});
  console.log(`LISTENING ${port} colyseus ${version}`);
}

module.exports = { createWorld, main, KNOWN_NPCS };
