// Server-sent events (the WHATWG event stream format), parsed from text as it arrives in pieces.
// Lines end in "\n" (a "\r" before it is dropped), as this server writes them.

/** Feeds text in; `push` returns the `data` of every event completed so far (lines joined by "\n"). */
export class SseParser {
  constructor() {
    this.buffer = "";
    this.dataLines = [];
  }

  push(text) {
    const lines = (this.buffer + text).split("\n");
    this.buffer = lines.pop(); // the line not ended yet
    const completed = [];
    for (const raw of lines) {
      const line = raw.endsWith("\r") ? raw.slice(0, -1) : raw;
      if (line === "") {
        if (this.dataLines.length) completed.push(this.dataLines.join("\n"));
        this.dataLines = [];
      } else if (line.startsWith("data:")) {
        this.dataLines.push(line.slice(5).replace(/^ /, ""));
      } // event:, id:, retry: and comments change nothing here: every event of this server is JSON data
    }
    return completed;
  }
}
