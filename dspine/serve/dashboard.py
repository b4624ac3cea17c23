"""`dspine dashboard`: a web page over the acceptance store — τ by workload × thinking level, per-slot
acceptance curves, τ over time, requests/s. One self-contained page (inline SVG drawn by inline script,
no external network at view time) that polls /api/summary; binds 127.0.0.1 by default.

Every drawn mark carries its value as a data attribute (data-tau, data-workload, ...), so a browser test
can compare what was rendered with what the store holds.
"""

from __future__ import annotations

from dspine.serve.store import AcceptanceStore

PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>dspine — acceptance</title>
<style>
 body{font:14px system-ui,sans-serif;margin:24px;color:#222;background:#fafafa}
 h1{font-size:20px;margin:0 0 4px} .sub{color:#666;margin-bottom:16px}
 .grid{display:grid;grid-template-columns:1fr 1fr;gap:16px}
 .card{background:#fff;border:1px solid #ddd;border-radius:8px;padding:12px}
 .card h2{font-size:15px;margin:0 0 8px} svg text{font-size:11px;fill:#333}
 table{border-collapse:collapse;font-size:13px} td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
 .legend span{display:inline-block;margin-right:12px} .sw{width:10px;height:10px;display:inline-block;margin-right:4px}
</style></head><body>
<h1>dspine — speculative acceptance</h1>
<div class="sub" id="status">loading…</div>
<div class="grid">
 <div class="card"><h2>τ by workload × thinking level</h2><svg id="bars" width="560" height="260"></svg>
   <div class="legend" id="bars-legend"></div></div>
 <div class="card"><h2>Per-slot acceptance P(slot k accepted)</h2><svg id="slots" width="560" height="260"></svg>
   <div class="legend" id="slots-legend"></div></div>
 <div class="card"><h2>τ over time</h2><svg id="tau-time" width="560" height="220"></svg></div>
 <div class="card"><h2>Requests per second</h2><svg id="rps" width="560" height="220"></svg></div>
</div>
<div class="card" style="margin-top:16px"><h2>Table</h2><table id="table"></table></div>
<script>
const NS = "http://www.w3.org/2000/svg";
const COLORS = ["#4e79a7","#f28e2b","#e15759","#76b7b2","#59a14f","#edc948","#b07aa1","#ff9da7","#9c755f","#bab0ac"];
function el(tag, attrs, parent, text){const e=document.createElementNS(NS,tag);for(const k in attrs)e.setAttribute(k,attrs[k]);
  if(text!==undefined)e.textContent=text; if(parent)parent.appendChild(e); return e;}
function clear(svg){while(svg.firstChild)svg.removeChild(svg.firstChild);}
function axes(svg,W,H,m,ymax,yfmt){el("line",{x1:m,y1:H-m,x2:W-8,y2:H-m,stroke:"#999"},svg);el("line",{x1:m,y1:8,x2:m,y2:H-m,stroke:"#999"},svg);
  for(let i=0;i<=4;i++){const v=ymax*i/4,y=H-m-(H-m-8)*i/4;el("text",{x:4,y:y+4},svg,yfmt(v));
  el("line",{x1:m,y1:y,x2:W-8,y2:y,stroke:"#eee"},svg);}}
function drawBars(cells){const svg=document.getElementById("bars");clear(svg);const W=560,H=260,m=40;
  const live=cells.filter(c=>c.tau_mean!==null);const ymax=Math.max(2,...live.map(c=>c.tau_mean))*1.1;axes(svg,W,H,m,ymax,v=>v.toFixed(1));
  const wl=[...new Set(cells.map(c=>c.workload))],th=[...new Set(cells.map(c=>c.thinking))];const gw=(W-m-16)/Math.max(1,wl.length),bw=gw*0.8/Math.max(1,th.length);
  wl.forEach((w,i)=>{el("text",{x:m+i*gw+gw/2,y:H-m+14,"text-anchor":"middle"},svg,w);
    th.forEach((t,j)=>{const c=cells.find(c=>c.workload===w&&c.thinking===t);if(!c||c.tau_mean===null)return;
      const h=(H-m-8)*c.tau_mean/ymax,x=m+i*gw+gw*0.1+j*bw;
      el("rect",{x:x,y:H-m-h,width:bw-2,height:h,fill:COLORS[j%COLORS.length],class:"tau-bar","data-workload":w,"data-thinking":t,
        "data-tau":c.tau_mean.toFixed(4),"data-requests":c.requests},svg);
      el("text",{x:x+(bw-2)/2,y:H-m-h-3,"text-anchor":"middle"},svg,c.tau_mean.toFixed(2));});});
  document.getElementById("bars-legend").innerHTML=th.map((t,j)=>`<span><i class="sw" style="background:${COLORS[j%COLORS.length]}"></i>thinking: ${t}</span>`).join("");}
function drawSlots(cells){const svg=document.getElementById("slots");clear(svg);const W=560,H=260,m=40;axes(svg,W,H,m,1,v=>v.toFixed(2));
  const live=cells.filter(c=>c.per_slot&&c.per_slot.length);const K=Math.max(1,...live.map(c=>c.per_slot.length));
  for(let k=0;k<K;k++)el("text",{x:m+(W-m-16)*k/Math.max(1,K-1),y:H-m+14,"text-anchor":"middle"},svg,String(k+1));
  live.forEach((c,i)=>{const pts=c.per_slot.map((p,k)=>[m+(W-m-16)*k/Math.max(1,K-1),H-m-(H-m-8)*p]);
    el("polyline",{points:pts.map(p=>p.join(",")).join(" "),fill:"none",stroke:COLORS[i%COLORS.length],"stroke-width":2,class:"slot-curve",
      "data-workload":c.workload,"data-thinking":c.thinking,"data-per-slot":c.per_slot.map(p=>p.toFixed(4)).join(" ")},svg);});
  document.getElementById("slots-legend").innerHTML=live.map((c,i)=>`<span><i class="sw" style="background:${COLORS[i%COLORS.length]}"></i>${c.workload} / ${c.thinking}</span>`).join("");}
function drawSeries(id,series,key,cls,fmt){const svg=document.getElementById(id);clear(svg);const W=560,H=220,m=40;
  const pts=series.filter(s=>s[key]!==null);const ymax=Math.max(key==="tau_mean"?2:0.01,...pts.map(s=>s[key]))*1.1;axes(svg,W,H,m,ymax,fmt);
  const n=Math.max(1,series.length-1);
  pts.forEach(s=>{const i=series.indexOf(s),x=m+(W-m-16)*(series.length>1?i/n:0.5),y=H-m-(H-m-8)*s[key]/ymax;
    el("circle",{cx:x,cy:y,r:4,fill:"#4e79a7",class:cls,"data-t":s.t,"data-value":s[key].toFixed(4)},svg);});
  if(pts.length>1)el("polyline",{points:pts.map(s=>{const i=series.indexOf(s);return [m+(W-m-16)*i/n,H-m-(H-m-8)*s[key]/ymax].join(",")}).join(" "),
    fill:"none",stroke:"#4e79a7"},svg);
  if(series.length){el("text",{x:m,y:H-m+14},svg,new Date(series[0].t*1000).toLocaleTimeString());
    el("text",{x:W-8,y:H-m+14,"text-anchor":"end"},svg,new Date(series[series.length-1].t*1000).toLocaleTimeString());}}
function drawTable(cells){const t=document.getElementById("table");
  t.innerHTML="<tr><th>workload</th><th>thinking</th><th>requests</th><th>τ (mean)</th><th>τ (pooled)</th><th>p50 latency s</th></tr>"+
  cells.map(c=>`<tr class="row" data-workload="${c.workload}" data-thinking="${c.thinking}"><td>${c.workload}</td><td>${c.thinking}</td><td>${c.requests}</td>`+
  `<td>${c.tau_mean===null?"—":c.tau_mean.toFixed(3)}</td><td>${c.tau_pooled===null?"—":c.tau_pooled.toFixed(3)}</td>`+
  `<td>${c.latency_p50_s===null?"—":c.latency_p50_s.toFixed(2)}</td></tr>`).join("");}
async function refresh(){try{const r=await fetch("api/summary");const s=await r.json();
  drawBars(s.cells);drawSlots(s.cells);drawSeries("tau-time",s.series,"tau_mean","tau-point",v=>v.toFixed(1));
  drawSeries("rps",s.series,"requests_per_s","rps-point",v=>v.toFixed(2));drawTable(s.cells);
  const st=document.getElementById("status");st.textContent=`${s.requests} requests recorded · updated ${new Date(s.generated*1000).toLocaleTimeString()}`;
  st.setAttribute("data-requests",s.requests);document.body.setAttribute("data-rendered","1");}
  catch(e){document.getElementById("status").textContent="cannot read the store: "+e;}}
refresh();setInterval(refresh,5000);
</script></body></html>
"""


def create_app(store: AcceptanceStore, bucket_s: float = 60.0):
    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse

    app = FastAPI(title="dspine dashboard", docs_url=None, redoc_url=None)

    @app.get("/")
    async def page():
        return HTMLResponse(PAGE)

    @app.get("/api/summary")
    async def summary(since: float = 0.0):
        return store.summary(since=since, bucket_s=bucket_s)

    return app


def serve_dashboard(db: str, host: str = "127.0.0.1", port: int = 8050, bucket_s: float = 60.0) -> None:
    import uvicorn

    uvicorn.run(create_app(AcceptanceStore(db), bucket_s), host=host, port=port, log_level="warning")
