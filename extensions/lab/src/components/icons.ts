/**
 * The Danlu icon (a GPU board with a rising curve), used by the sidebar tab and
 * the cell toolbar button.
 */
import { LabIcon } from '@jupyterlab/ui-components';

const svgstr = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <path d="M3 5h18a1 1 0 0 1 1 1v10a1 1 0 0 1-1 1H3a1 1 0 0 1-1-1V6a1 1 0 0 1 1-1zm1 2v8h16V7H4zM5 18h2v2H5zm4 0h2v2H9zm4 0h2v2h-2zm4 0h2v2h-2z"/>
    <path d="M5.5 13.5l3.2-3.4 2.6 2 4.3-4.6 1.4 1.3-5.5 5.9-2.6-2-2 2.1z"/>
  </g>
</svg>`;

export const danluIcon = new LabIcon({ name: 'danlu-lab:danlu', svgstr });
