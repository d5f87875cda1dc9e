// Server-sent events from a fetch() Response (EventSource can't POST or send an Authorization header).
// Yields each event's data (its "data:" lines joined by "\n"), e.g. a JSON chunk or "[DONE]".

export async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r/g, "");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = parseEvent(block);
        if (data !== null) yield data;
      }
    }
    buffer += decoder.decode();
    const data = parseEvent(buffer.replace(/\r/g, ""));
    if (data !== null) yield data;
  } finally {
    reader.releaseLock();
  }
}

function parseEvent(block) {
  const lines = [];
  for (const line of block.split("\n")) {
    if (line.startsWith("data:")) lines.push(line.slice(line.startsWith("data: ") ? 6 : 5));
  }
  return lines.length ? lines.join("\n") : null;
}
