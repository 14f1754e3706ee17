// The dashboard's live updates: the server-sent event stream, read with fetch() so the key goes in a header
// (EventSource cannot send one), and a slow refresh besides it (rates, heartbeats and ages change without a job
// event). When the stream fails the badge says "polling", the view refreshes every 2 s and the stream is retried.
//
// makeLive({ token, active, changed, refresh }): token() the key to send; active() false once signed out;
// changed() called for each jobs/resync event (the caller throttles); refresh() the slow refresh.
export function makeLive({ token, active, changed, refresh }) {
  let stream = null; // AbortController of the event stream
  let retryMs = 1000;
  let tickTimer = null;
  const badge = () => document.getElementById("live");

  function setMode(mode) {
    badge().dataset.mode = mode;
    badge().textContent = mode === "live" ? "live" : "polling";
  }

  function tick() {
    clearTimeout(tickTimer);
    if (!active()) return;
    tickTimer = setTimeout(() => { refresh(); tick(); }, badge().dataset.mode === "live" ? 5000 : 2000);
  }

  async function connect() {
    if (stream) stream.abort();
    const ctl = new AbortController();
    stream = ctl;
    try {
      const r = await fetch("/v1/events", { headers: { Authorization: `Bearer ${token()}`,
        Accept: "text/event-stream" }, signal: ctl.signal, cache: "no-store", credentials: "omit" });
      if (!r.ok || !r.body) throw new Error(`event stream: HTTP ${r.status}`);
      setMode("live");
      retryMs = 1000;
      const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += value.replace(/\r\n/g, "\n");
        let i;
        while ((i = buf.indexOf("\n\n")) >= 0) {
          const frame = buf.slice(0, i);
          buf = buf.slice(i + 2);
          if (/^event: (jobs|resync)$/m.test(frame)) changed();
        }
      }
    } catch (_) { /* network error or aborted: handled below */ }
    if (ctl.signal.aborted || stream !== ctl || !active()) return;
    setMode("polling");
    tick();
    setTimeout(() => { if (stream === ctl && active()) connect(); }, retryMs);
    retryMs = Math.min(retryMs + 1000, 15000); // a server restart is back within seconds; a proxy that cuts streams is not
  }

  return {
    start() {
      setMode("polling");
      connect();
      tick();
    },
    stop() {
      if (stream) stream.abort();
      stream = null;
      clearTimeout(tickTimer);
    },
  };
}
